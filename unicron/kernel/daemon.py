"""The entry point both daemons share: flags with env fallbacks -> settings, JSON logs, and
SIGTERM/SIGINT turned into a clean stop (systemd stops units with SIGTERM)."""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable
from types import FrameType
from typing import Protocol, TypeVar

from unicron.kernel import config
from unicron.kernel import log as ulog
from unicron.kernel.errors import ConfigError


class Daemon(Protocol):
    def run(self) -> int: ...

    def stop(self) -> None: ...


S = TypeVar("S")


def main(prog: str, description: str, settings_cls: type[S], build: Callable[[S], Daemon],
         argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    config.add_arguments(parser, settings_cls)
    args = parser.parse_args(argv)
    try:
        settings = config.from_args(settings_cls, args)
    except ConfigError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    try:
        ulog.configure(str(getattr(settings, "log_level", "INFO")))
        daemon = build(settings)
    except ConfigError as exc:  # a setting only the daemon's parts can judge (e.g. the monitor's thresholds)
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2

    def on_signal(signum: int, frame: FrameType | None) -> None:
        daemon.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        return daemon.run()
    except ConfigError as exc:  # found while starting: an address that cannot be listened on, a directory
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
