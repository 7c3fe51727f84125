"""``unicron-agent``: the per-node agent daemon (run one per node, under systemd)."""

from __future__ import annotations

import sys

from agent.settings import AgentSettings
from unicron.kernel import daemon


def _build(settings: AgentSettings) -> daemon.Daemon:
    from agent.daemon import Agent
    from unicron.kernel import log as ulog

    ulog.bind_process(node=settings.node)  # one agent per process here (a hollow fleet runs many: not bound)
    return Agent(settings)


def main(argv: list[str] | None = None) -> int:
    return daemon.main("unicron-agent", __doc__ or "", AgentSettings, _build, argv)


if __name__ == "__main__":
    sys.exit(main())
