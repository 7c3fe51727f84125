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


#: arguments that become names, etcd keys or request fields
NAMES = ("name", "node", "task", "prefix", "arg", "api", "etcd")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for dest in NAMES:
        value = getattr(args, dest, None)
        # a byte the locale could not decode arrives as a lone surrogate, which no request or etcd key
        # can carry: each failed later with a traceback when it was encoded (a file path is fine: open()
        # takes it back as the same bytes)
        if isinstance(value, str) and any("\ud800" <= c <= "\udfff" for c in value):
            print(f"unicron {args.command}: {dest} {value.encode('utf-8', 'surrogateescape')!r} is not UTF-8 "
                  "text; names, keys and addresses must be", file=sys.stderr)
            return 2
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
