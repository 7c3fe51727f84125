"""The benchmarks' own harness functions (imported from bench/) driven with crafted inputs: a figure
must be able to fail, and one that would hide a failure is caught here without running a cluster."""

from __future__ import annotations

import itertools
import json
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from unicron.cluster.etcd_server import EtcdServer
from unicron.kernel.etcd import Store
from unicron.kernel.keyspace import Keyspace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "bench"))


class _FakeClock:
    """Stands in for the ``time`` module inside bench/reconnect.py: every monotonic() read is 5 s
    later and sleep() returns at once, so its give-up deadline passes within milliseconds."""

    def __init__(self) -> None:
        self._t = itertools.count(0.0, 5.0)

    def monotonic(self) -> float:
        return float(next(self._t))

    def sleep(self, s: float) -> None:
        pass


def test_reconnect_an_agent_that_never_writes_again_is_not_dropped_from_the_figures(
    etcd_server: EtcdServer, prefix: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before: reconnect.one_outage() returned only the agents that wrote their status again, so one
    that never reconnected dropped out and ``reconnect_max_s`` / ``target_met`` read the others. Now
    it gives one sample per agent, a missing one as inf (the max and the target fail on it). Here
    node0 writes at once after the outage and node1 never does."""
    import reconnect  # type: ignore[import-not-found,unused-ignore]

    keys = Keyspace(prefix)

    class Probe(Store):
        """The bench's probe client; node0's agent writes its status right after etcd is back."""

        def revision(self) -> int:
            rev = super().revision()
            self.put(keys.status("node0"), "{}")
            return rev

    class Cluster:
        etcd = etcd_server
        keys = Keyspace(prefix)

        def node_names(self) -> list[str]:
            return ["node0", "node1"]

    monkeypatch.setattr(reconnect, "time", _FakeClock())
    monkeypatch.setattr(reconnect, "Store", Probe)
    got = reconnect.one_outage(Cluster(), 0.0)  # type: ignore[arg-type,unused-ignore]
    assert len(got) == 2 and math.isfinite(got[0]) and math.isinf(got[1]), got
    summary = reconnect.summary(got)
    assert summary["max_s"] is None and summary["missed"] == 1, summary


@pytest.fixture
def tls_api(cert_dir: Path) -> Iterator[tuple[str, Any]]:
    from coordinator.api import serve, stop
    from tests.coordinator.test_api import FakeControlPlane
    from unicron.kernel import tls

    plane = FakeControlPlane()
    server, address = serve(plane, "127.0.0.1", 0, tls_config=tls.TLSConfig.from_dir(cert_dir, "coordinator"))
    try:
        yield address, plane
    finally:
        stop(server, 0.1)


def test_security_a_forbidden_call_answered_by_the_handler_counts_as_accepted(
    tls_api: tuple[str, Any], cert_dir: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before: bench/security.py took any gRPC error for a refusal, and its "api cancel, coordinator
    certificate" probe named a task that did not exist, so the NOT_FOUND read as "refused" even with
    the API's role check removed: that probe could not fail. Now only PERMISSION_DENIED,
    UNAUTHENTICATED and UNAVAILABLE are refusals (and the bench submits the task first); an answer
    from the handler, past the guard, counts as accepted."""
    import security  # type: ignore[import-not-found,unused-ignore]

    from coordinator import api as coordinator_api
    from unicron.kernel import tls
    from unicron.kernel.proto import coordinator_pb2 as pb

    address, plane = tls_api
    coordinator_cert = tls.TLSConfig.from_dir(cert_dir, "coordinator")
    cancel = pb.CancelRequest(name="probe")
    assert security.api_accepted(address, coordinator_cert, "Cancel", cancel) is False  # the role check holds
    monkeypatch.setattr(coordinator_api, "authorize", lambda context, rpc: None)  # the guard is gone
    submit = pb.SubmitRequest(spec_json=json.dumps(security.SPEC))
    assert security.api_accepted(address, coordinator_cert, "Submit", submit) is True
    plane.specs.clear()  # no task "probe": the cancel is answered NOT_FOUND, by the handler
    assert security.api_accepted(address, coordinator_cert, "Cancel", cancel) is True, (
        "the coordinator's certificate got past a missing role check, yet the probe says refused")
    assert security.api_ok(address, coordinator_cert, "Cancel", cancel) is False  # a control needs OK


def test_soak_headline_false_alarms_can_fail() -> None:
    """Before: every stall of bench/soak.py's headline (``reported``) traces sat in a phase that stops
    the hang clock, leaving +-3 % noise, so ``false_alarms`` read 0 even for a detector firing at
    1.25x the mean: a setting of the trace model. Now the traces carry what no rank reports (a lost
    GC start, heavy-tailed compute noise, scheduling hiccups), and such a detector raises false alarms
    on them, while the shipped settings stay at 0 on the same traces."""
    import soak  # type: ignore[import-not-found,unused-ignore]

    from agent.iterations import IterationSettings

    trigger_happy = IterationSettings(hang_factor=1.25, tail_margin=0.0)
    out = soak.soak([0], 2, 5000, trigger_happy)
    assert out["false_alarms_gc_unreported"] > 0  # the detector is trigger-happy indeed
    assert out["false_alarms"] > 0, (
        f"a detector firing at 1.25x the mean reads false_alarms={out['false_alarms']} on the headline traces")
    assert soak.soak([0], 2, 5000, IterationSettings())["false_alarms"] == 0
