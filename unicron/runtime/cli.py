"""``unicron train``: registration of the subcommand (no torch import until the command runs, so
``unicron --help`` and other subcommands stay fast). The flags are in :mod:`unicron.runtime.flags`."""

from __future__ import annotations

import argparse

from unicron.runtime.flags import ENV_PREFIX, add_arguments, env_name

__all__ = ["ENV_PREFIX", "add_arguments", "env_name", "register"]


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
