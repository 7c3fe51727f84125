"""``unicron demo``: placeholder registration; the demo itself lives in unicron.demo."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("demo", help="run the local self-healing demo (throwaway etcd, coordinator, 3 agents)")
    p.add_argument("--quick", action="store_true", help="shorter waits")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from unicron.demo import run_demo

    return run_demo(quick=args.quick)
