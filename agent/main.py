"""``unicron-agent``: the per-node agent daemon (run one per node, under systemd)."""

from __future__ import annotations

import os

# The agent forks its ranks (with a pre-exec hook for PDEATHSIG) while gRPC threads (the etcd
# client) run; gRPC's fork handlers then break the child before it can exec (seen: SIGABRT).
# Nothing gRPC is used between fork and exec, so the handlers are not needed.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import argparse
import signal
import sys
from types import FrameType

from agent.settings import AgentSettings
from unicron import config
from unicron import log as ulog
from unicron.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="unicron-agent", description=__doc__)
    config.add_arguments(parser, AgentSettings)
    args = parser.parse_args(argv)
    try:
        settings = config.from_args(AgentSettings, args)
    except ConfigError as exc:
        print(f"unicron-agent: {exc}", file=sys.stderr)
        return 2
    ulog.configure(settings.log_level)
    from agent.daemon import Agent

    agent = Agent(settings)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        agent.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return agent.run()


if __name__ == "__main__":
    sys.exit(main())
