"""``unicron-coordinator``: the cluster's coordinator daemon (run one or more; one leads)."""

from __future__ import annotations

import sys

from coordinator.settings import CoordinatorSettings
from unicron.kernel import daemon


def _build(settings: CoordinatorSettings) -> daemon.Daemon:
    from coordinator.daemon import Coordinator

    return Coordinator(settings)


def main(argv: list[str] | None = None) -> int:
    return daemon.main("unicron-coordinator", __doc__ or "", CoordinatorSettings, _build, argv)


if __name__ == "__main__":
    sys.exit(main())
