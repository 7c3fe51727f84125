"""``python -m unicron.runtime.train`` / ``unicron train``: managed training of a small Megatron GPT.

One process per rank, torchrun-style environment (set by the agent or :mod:`unicron.cluster.launch`):
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` (the task's store sidecar,
:mod:`unicron.runtime.store`), and optionally ``UNICRON_AGENT_SOCKET``, ``UNICRON_TASK``,
``UNICRON_GENERATION``, ``UNICRON_NODE``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from unicron.kernel import log as ulog
from unicron.kernel.client import AgentClient
from unicron.kernel.errors import ConfigError, PermanentError, TemporaryError
from unicron.runtime import store as keys
from unicron.runtime.checkpoint import make_checkpointer
from unicron.runtime.data import make_source
from unicron.runtime.faults import FaultScript
from unicron.runtime.flags import add_arguments
from unicron.runtime.heartbeat import Heartbeat
from unicron.runtime.membership import CommSettings
from unicron.runtime.model import ModelConfig, ensure_torch_distributed
from unicron.runtime.plan import Topology
from unicron.runtime.scheduler import ScheduleConfig, Trainer
from unicron.runtime.state import OptimConfig

EXIT_CONFIG = 2


def _env_int(name: str, default: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None:
        if default is None:
            raise ConfigError(f"environment variable {name} is not set (the agent or launcher sets it)")
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from exc


def configs(args: argparse.Namespace, world: int) -> tuple[ModelConfig, OptimConfig, ScheduleConfig, CommSettings]:
    model = ModelConfig(
        layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq, vocab=args.vocab,
        dtype=args.dtype, dropout=args.dropout, init_seed=args.init_seed,
    )
    model.validate(args.tp)
    if args.micro_batch_size < 1 or args.global_batch_size % args.micro_batch_size:
        raise ConfigError(
            f"--global-batch-size {args.global_batch_size} must be a positive multiple of "
            f"--micro-batch-size {args.micro_batch_size}"
        )
    if args.iterations < 0:
        raise ConfigError(f"--iterations must be >= 0, got {args.iterations}")
    if args.manual_gc_interval < 0:
        raise ConfigError(f"--manual-gc-interval must be >= 0, got {args.manual_gc_interval}")
    if args.threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {args.threads}")
    if args.regroup_timeout <= args.collective_timeout:
        raise ConfigError("--regroup-timeout must exceed --collective-timeout")
    sched = ScheduleConfig(
        micro_batches=args.global_batch_size // args.micro_batch_size, blocks=args.blocks,
        micro_batch_size=args.micro_batch_size, iterations=args.iterations, deterministic=args.deterministic,
        bucket_elems=args.bucket_elems, recovery=args.recovery, seed=args.seed, iter_sleep=args.iter_sleep,
        join_timeout_s=args.join_timeout, manual_gc_interval=args.manual_gc_interval,
    )
    comm = CommSettings(
        collective_timeout_s=args.collective_timeout, regroup_timeout_s=args.regroup_timeout,
        heartbeat_window_s=args.heartbeat_window, backend=args.backend,
    )
    return model, OptimConfig(lr=args.lr), sched, comm


@dataclass
class Rank:
    """A rank's runtime, built from the command line and environment but not yet running."""

    trainer: Trainer
    heartbeat: Heartbeat
    client: AgentClient


def build(args: argparse.Namespace) -> Rank:
    """Validate ``args`` and the environment, connect to the store and the agent, build the Trainer.
    Raises ConfigError / TemporaryError with a message naming the flag or variable."""
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    host, port = os.environ.get("MASTER_ADDR", ""), _env_int("MASTER_PORT")
    topo = Topology(world, args.tp)
    if not 0 <= rank < world:
        raise ConfigError(f"RANK={rank} is outside WORLD_SIZE={world}")
    model_cfg, optim_cfg, sched, comm = configs(args, world)
    data = make_source(args.data_file or None, args.vocab, args.seq, args.micro_batch_size, args.seed)
    if args.ckpt_every < 0:
        raise ConfigError(f"--ckpt-every must be >= 0, got {args.ckpt_every}")
    if args.ckpt not in ("none", "torch-save", "memory"):
        raise ConfigError(f"--ckpt {args.ckpt!r}: choose none, torch-save or memory")
    if not 0 < args.heartbeat_interval < args.heartbeat_window:
        raise ConfigError("--heartbeat-interval must be > 0 and below --heartbeat-window")
    heartbeat = Heartbeat(host, port, rank, interval_s=args.heartbeat_interval, world=world).start()  # forks
    try:
        store = keys.connect(host, port)
        torch.set_num_threads(args.threads)
        ensure_torch_distributed()
        checkpointer = make_checkpointer(args.ckpt, args.ckpt_dir, os.environ.get("UNICRON_TASK", ""), rank)
        incarnation = int(store.add(keys.started_key(rank), 1))
    except BaseException:
        heartbeat.stop()
        raise
    client = AgentClient.from_env().connect()
    client.install_excepthook()
    trainer = Trainer(
        rank=rank, topo=topo, store=store, incarnation=incarnation, model_cfg=model_cfg, optim_cfg=optim_cfg,
        sched=sched, comm=comm, data=data, client=client,
        faults=FaultScript.from_env(rank, incarnation, store), checkpointer=checkpointer,
        ckpt_every=args.ckpt_every, resume=args.resume, watcher=heartbeat,
    )
    return Rank(trainer, heartbeat, client)


def run(args: argparse.Namespace) -> int:
    ulog.configure(os.environ.get("UNICRON_LOG_LEVEL", "WARNING"))
    try:
        built = build(args)
    except (ConfigError, TemporaryError) as exc:
        print(f"unicron train: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    trainer, heartbeat, client = built.trainer, built.heartbeat, built.client
    try:
        code = trainer.run()
    except PermanentError as exc:
        client.report_exception(exc, fatal=True)
        print(f"unicron train: rank {trainer.rank}: {exc}", file=sys.stderr)
        code = 1
    finally:
        heartbeat.stop()
        if args.out_dir:
            trainer.write_outputs(args.out_dir)
    client.close()
    return code


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m unicron.runtime.train", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
