"""The flags of ``unicron train`` / ``python -m unicron.runtime.train`` (no torch import, so that
``unicron --help`` stays fast). :mod:`unicron.runtime.train` and :mod:`unicron.runtime.cli` both
import this module; neither imports the other at module level."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

from unicron.kernel.config import finite_float

ENV_PREFIX = "UNICRON_TRAIN_"
EXIT_CONFIG = 2
"""Exit status of a rank whose flags or environment are wrong (its one-line error is on stderr)."""


def env_name(flag: str) -> str:
    """``--global-batch-size`` -> ``UNICRON_TRAIN_GLOBAL_BATCH_SIZE``."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def _env_type(kind: Callable[[str], Any], env: str) -> Callable[[str], Any]:
    def convert(raw: str) -> Any:
        try:
            return kind(raw)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{raw!r} is not a valid {name} (flag or {env})") from exc

    name = "number" if kind is finite_float else kind.__name__
    convert.__name__ = name
    return convert


def _opt(group: Any, flag: str, **kw: Any) -> None:
    """A flag whose default comes from ``UNICRON_TRAIN_<FLAG>`` when that is set (the agent passes a
    task's settings through the environment); the help names the variable."""
    env = env_name(flag)
    kw["help"] = f"{kw.get('help', '')} [env {env}]"
    raw = os.environ.get(env)
    if kw.get("action") == "store_true":
        if raw is not None:
            low = raw.strip().lower()
            if low not in ("1", "true", "yes", "on", "0", "false", "no", "off", ""):
                # SystemExit(message) exits 1; a bad setting's documented status is EXIT_CONFIG
                print(f"unicron train: {env}={raw!r}: expected true or false (1/0, yes/no, on/off)",
                      file=sys.stderr)
                raise SystemExit(EXIT_CONFIG)
            kw["default"] = low in ("1", "true", "yes", "on")
        group.add_argument(flag, **kw)
        return
    kind = kw.pop("type", str)
    kw["type"] = _env_type(finite_float if kind is float else kind, env)
    if raw is not None:
        kw["default"] = raw  # argparse converts a string default with ``type``, naming the flag on error
    group.add_argument(flag, **kw)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Every flag of ``unicron train``: the GPT's own and the runtime's."""
    add_gpt_arguments(p)
    add_runtime_arguments(p)


def add_gpt_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of ``unicron train``'s model and data (the GPT user of :func:`unicron.runtime.pretrain`)."""
    m = p.add_argument_group("model")
    _opt(m, "--layers", type=int, default=2, help="transformer layers (default 2)")
    _opt(m, "--hidden", type=int, default=128, help="hidden size (default 128)")
    _opt(m, "--heads", type=int, default=4, help="attention heads (default 4)")
    _opt(m, "--seq", type=int, default=64, help="sequence length (default 64)")
    _opt(m, "--vocab", type=int, default=128, help="vocabulary size (default 128)")
    _opt(m, "--dtype", default="float32", help="float32 | float64 | bfloat16 (default float32)")
    _opt(m, "--dropout", type=float, default=0.0, help="dropout probability (default 0)")
    d = p.add_argument_group("data")
    _opt(d, "--data-path", default="",
         help="prefix of a Megatron indexed dataset (PREFIX.bin + PREFIX.idx, tools/preprocess_data.py)")
    _opt(d, "--data-file", default="", help=".npy of token ids, or any file read as bytes (default: generated)")
    return p


def add_runtime_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags every job on the runtime takes (:func:`unicron.runtime.pretrain` adds them)."""
    t = p.add_argument_group("training")
    _opt(t, "--tp", type=int, default=1, help="tensor-parallel size; divides WORLD_SIZE (default 1)")
    _opt(t, "--global-batch-size", type=int, default=64,
         help="samples per iteration (default 64: 16 micro-batches; ~0.2 s per iteration on CPU, 2 ranks)")
    _opt(t, "--micro-batch-size", type=int, default=4, help="samples per micro-batch (default 4)")
    _opt(t, "--iterations", type=int, default=10, help="iterations to run, 0 = until stopped (default 10)")
    _opt(t, "--lr", type=float, default=1e-3, help="Adam learning rate (default 1e-3)")
    _opt(t, "--seed", type=int, default=1, help="seed of data order and per-micro-batch RNG (default 1)")
    _opt(t, "--init-seed", type=int, default=1234, help="seed of parameter initialisation (default 1234)")
    _opt(t, "--iter-sleep", type=float, default=0.0, help="artificial delay per iteration, seconds")
    _opt(t, "--threads", type=int, default=1, help="torch intra-op threads, pinned (default 1)")
    s = p.add_argument_group("scheduler")
    _opt(s, "--deterministic", action="store_true", help="bit-identical results for any DP split")
    _opt(s, "--blocks", type=int, default=0, help="canonical reduction blocks (default: initial DP size)")
    _opt(s, "--bucket-elems", type=int, default=1 << 22,
         help="elements per gradient bucket (completed buckets survive a failure; default 4M)")
    _opt(s, "--recovery", default="redistribute", choices=("redistribute", "rerun"),
         help="after a failure keep completed micro-batches (redistribute) or rerun the iteration")
    _opt(s, "--backend", default="gloo", choices=("gloo", "nccl"), help="process-group backend")
    _opt(s, "--device", default="auto", choices=("auto", "cpu", "cuda"),
         help="where the model and the collectives' tensors live; cuda: the GPU numbered LOCAL_RANK among "
              "the visible ones (auto: cuda with --backend nccl, else cpu)")
    _opt(s, "--collective-timeout", type=float, default=30.0, help="collective timeout, seconds")
    _opt(s, "--regroup-timeout", type=float, default=90.0, help="regroup deadline, seconds (> collective)")
    _opt(s, "--heartbeat-window", type=float, default=5.0, help="heartbeat staleness window, seconds")
    _opt(s, "--heartbeat-interval", type=float, default=0.5,
         help="seconds between heartbeats (default 0.5; well below --heartbeat-window)")
    _opt(s, "--manual-gc-interval", type=int, default=0,
         help="collect Python garbage only every N iterations, on all ranks at once (0: automatic)")
    _opt(s, "--join-timeout", type=float, default=600.0, help="how long a restarted rank waits to join")
    c = p.add_argument_group("checkpoints")
    _opt(c, "--ckpt", default="none", choices=("none", "torch-save", "memory"),
         help="checkpointer: in-memory (ckpt subsystem) or torch.save files (default none)")
    _opt(c, "--ckpt-dir", default="", help="directory of torch-save files / in-memory slots")
    _opt(c, "--ckpt-every", type=int, default=0, help="checkpoint every N iterations (0: never)")
    _opt(c, "--resume", action="store_true", help="start from the newest checkpoint")
    _opt(c, "--ckpt-storage", default="",
         help="--ckpt memory's remote tier: a directory (a shared filesystem) snapshots are persisted to in the "
              "background, so the task survives losing every node; default <ckpt-dir>/persisted when --ckpt-dir "
              "is given, 'none' for no remote tier")
    _opt(c, "--ckpt-persist-every", type=int, default=1,
         help="--ckpt memory: persist every Nth snapshot to --ckpt-storage (default 1; a stop's snapshot always)")
    _opt(c, "--stop-snapshot", default="on", choices=("on", "off"),
         help="on SIGTERM (or any stop) save a snapshot at the iteration boundary before exiting (default on)")
    o = p.add_argument_group("outputs")
    _opt(o, "--log-iterations", action="store_true",
         help="print 'iteration N done TS pid P dp D' on stdout as each iteration commits (benchmarks)")
    _opt(o, "--out-dir", default="", help="write rank<R>.json (events, losses) and rank<R>.pt (params)")
    return p
