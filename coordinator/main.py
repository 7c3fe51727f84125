"""``unicron-coordinator``: the cluster's coordinator daemon (run one or more; one leads)."""

from __future__ import annotations

import argparse
import signal
import sys
from types import FrameType

from coordinator.daemon import Coordinator
from coordinator.settings import CoordinatorSettings
from unicron import config
from unicron import log as ulog
from unicron.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="unicron-coordinator", description=__doc__)
    config.add_arguments(parser, CoordinatorSettings)
    args = parser.parse_args(argv)
    try:
        settings = config.from_args(CoordinatorSettings, args)
    except ConfigError as exc:
        print(f"unicron-coordinator: {exc}", file=sys.stderr)
        return 2
    ulog.configure(settings.log_level)
    coordinator = Coordinator(settings)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        coordinator.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return coordinator.run()


if __name__ == "__main__":
    sys.exit(main())
