"""``unicron train``: argument definitions and registration (no torch import until the command runs,
so ``unicron --help`` and other subcommands stay fast)."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model")
    m.add_argument("--layers", type=int, default=2, help="transformer layers (default 2)")
    m.add_argument("--hidden", type=int, default=128, help="hidden size (default 128)")
    m.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    m.add_argument("--seq", type=int, default=64, help="sequence length (default 64)")
    m.add_argument("--vocab", type=int, default=128, help="vocabulary size (default 128)")
    m.add_argument("--dtype", default="float32", help="float32 | float64 | bfloat16 (default float32)")
    m.add_argument("--dropout", type=float, default=0.0, help="dropout probability (default 0)")
    m.add_argument("--tp", type=int, default=1, help="tensor-parallel size; divides WORLD_SIZE (default 1)")
    t = p.add_argument_group("training")
    t.add_argument("--global-batch-size", type=int, default=64,
                   help="samples per iteration (default 64: 16 micro-batches; ~0.2 s per iteration on CPU, 2 ranks)")
    t.add_argument("--micro-batch-size", type=int, default=4, help="samples per micro-batch (default 4)")
    t.add_argument("--iterations", type=int, default=10, help="iterations to run, 0 = until stopped (default 10)")
    t.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default 1e-3)")
    t.add_argument("--seed", type=int, default=1, help="seed of data order and per-micro-batch RNG (default 1)")
    t.add_argument("--init-seed", type=int, default=1234, help="seed of parameter initialisation (default 1234)")
    t.add_argument("--data-file", default="", help=".npy of token ids, or any file read as bytes (default: generated)")
    t.add_argument("--iter-sleep", type=float, default=0.0, help="artificial delay per iteration, seconds")
    t.add_argument("--threads", type=int, default=1, help="torch intra-op threads, pinned (default 1)")
    s = p.add_argument_group("scheduler")
    s.add_argument("--deterministic", action="store_true", help="bit-identical results for any DP split")
    s.add_argument("--blocks", type=int, default=0, help="canonical reduction blocks (default: initial DP size)")
    s.add_argument("--bucket-elems", type=int, default=1 << 22,
                   help="elements per gradient bucket (completed buckets survive a failure; default 4M)")
    s.add_argument("--recovery", default="redistribute", choices=("redistribute", "rerun"),
                   help="after a failure keep completed micro-batches (redistribute) or rerun the iteration")
    s.add_argument("--backend", default="gloo", choices=("gloo", "nccl"), help="process-group backend")
    s.add_argument("--collective-timeout", type=float, default=30.0, help="collective timeout, seconds")
    s.add_argument("--regroup-timeout", type=float, default=90.0, help="regroup deadline, seconds (> collective)")
    s.add_argument("--heartbeat-window", type=float, default=5.0, help="heartbeat staleness window, seconds")
    s.add_argument("--heartbeat-interval", type=float, default=0.2, help="seconds between heartbeats")
    s.add_argument("--join-timeout", type=float, default=600.0, help="how long a restarted rank waits to join")
    c = p.add_argument_group("checkpoints")
    c.add_argument("--ckpt", default="none", choices=("none", "torch-save", "memory"),
                   help="checkpointer: in-memory (ckpt subsystem) or torch.save files (default none)")
    c.add_argument("--ckpt-dir", default="", help="directory of torch-save files / in-memory slots")
    c.add_argument("--ckpt-every", type=int, default=0, help="checkpoint every N iterations (0: never)")
    c.add_argument("--resume", action="store_true", help="start from the newest checkpoint")
    o = p.add_argument_group("outputs")
    o.add_argument("--out-dir", default="", help="write rank<R>.json (events, losses) and rank<R>.pt (params)")


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "train",
        help="run managed training of a small Megatron GPT (one process per rank, torchrun-style env)",
        description="One rank of managed training: a Megatron-core GPT on CPU (gloo) or GPU (nccl) whose "
        "iterations survive rank failures by redistributing micro-batches. Environment: RANK, WORLD_SIZE, "
        "MASTER_ADDR, MASTER_PORT (the task store sidecar, python -m unicron.runtime.store), optional "
        "UNICRON_AGENT_SOCKET.",
    )
    add_arguments(p)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from unicron.runtime.train import run

    return run(args)
