"""Fuzzed inputs to every parser of untrusted data and to the real servers (issue 17 item 6).

The properties of ``tests/fuzz/harness.py`` (the CI tests run them with small counts), here with large
ones. Pure targets: the rank <-> agent protocol, the agent link messages, task specs, every record a
daemon reads from etcd, the decision core's state. Real servers: the agent's RankServer on a Unix
socket, the coordinator's LinkServer on TCP, the gRPC API of a real coordinator on a real etcd, and the
records that coordinator watches written into its etcd (each then still answers a valid peer).

``fuzz_cases`` counts the inputs the harness actually executed; ``fuzz_crashes`` counts exceptions
outside InvalidRecord/PermanentError, rejections that are not one line naming the field, accepted
values of a wrong type, cases over 5 s, server threads that died and servers that stopped answering.
(``unauthorized_accepted`` and the TLS figures belong to the TLS item of issue 17, not to this bench.)

    flock /tmp/unicron-heavy.lock .venv/bin/python bench/fuzz.py [--quick]

The last line is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.fuzz.harness import (
    PURE_TARGETS,
    Fuzz,
    run_api,
    run_coordinator_etcd,
    run_link_server,
    run_pure,
    run_rank_server,
)

#: examples per target: (quick, full); the full run is >= 10,000 inputs in all
COUNTS = {
    **{t: (400, 2000) for t in PURE_TARGETS},
    "rank_server": (300, 1500),
    "link_server": (300, 1500),
    "api_submit": (150, 800),
    "coordinator_etcd": (150, 800),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller count (under a minute)")
    args = parser.parse_args()
    pick = 0 if args.quick else 1
    fuzz = Fuzz(raise_on_crash=False)
    start = time.monotonic()
    for target in sorted(PURE_TARGETS):
        run_pure(fuzz, target, COUNTS[target][pick])
        print(f"{target}: {fuzz.cases[target]} cases, {time.monotonic() - start:.1f}s", file=sys.stderr)
    run_rank_server(fuzz, COUNTS["rank_server"][pick])
    run_link_server(fuzz, COUNTS["link_server"][pick])
    run_api(fuzz, COUNTS["api_submit"][pick])
    run_coordinator_etcd(fuzz, COUNTS["coordinator_etcd"][pick])
    result = {"bench": "fuzz", "quick": args.quick, **fuzz.summary(), "wall_s": round(time.monotonic() - start, 1)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
