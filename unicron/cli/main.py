"""``unicron``: the command-line interface.

Subcommands live in their own modules, each exposing ``register(subparsers)``; this file only
collects them. A command module that fails to import (e.g. an optional dependency missing) takes
only its own subcommands away, with the reason shown in ``unicron --help``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from unicron.cli.common import one_line
from unicron.kernel.errors import UnicronError

COMMAND_MODULES = (
    "unicron.cli.cluster",
    "unicron.cli.inject",
    "unicron.cli.tasks",
    "unicron.cli.demo",
    "unicron.runtime.cli",
    "plans.cli",
    "unicron.cli.simulate",
    "unicron.cli.certs",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="unicron", description="Self-healing workload manager for LLM training.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    missing: list[str] = []
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            missing.append(f"{name} ({exc})")
            continue
        module.register(sub)
    if missing:
        parser.epilog = "unavailable command modules: " + "; ".join(missing)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    raw = sys.argv[1:] if argv is None else argv
    for i, arg in enumerate(raw, 1):
        # a byte the locale could not decode arrives as a lone surrogate, which no name, key or
        # request can carry (each would fail later, with a traceback, when it is encoded)
        if any("\ud800" <= c <= "\udfff" for c in arg):
            print(f"unicron: argument {i} ({arg.encode('utf-8', 'surrogateescape')!r}) is not UTF-8 text; "
                  "names, keys and paths must be", file=sys.stderr)
            return 2
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return int(func(args))
    except UnicronError as exc:
        print(f"unicron {args.command}: {one_line(str(exc))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
