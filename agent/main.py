"""``unicron-agent``: the per-node agent daemon (run one per node, under systemd)."""

from __future__ import annotations

import os

# The agent forks its ranks (with a pre-exec hook for PDEATHSIG) while gRPC threads (the etcd
# client) run; gRPC's fork handlers then break the child before it can exec (seen: SIGABRT).
# Nothing gRPC is used between fork and exec, so the handlers are not needed.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import sys

from agent.settings import AgentSettings
from unicron.kernel import daemon


def _build(settings: AgentSettings) -> daemon.Daemon:
    from agent.daemon import Agent

    return Agent(settings)


def main(argv: list[str] | None = None) -> int:
    return daemon.main("unicron-agent", __doc__ or "", AgentSettings, _build, argv)


if __name__ == "__main__":
    sys.exit(main())
