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


def test_transition_reattempt_clock_does_not_stop_at_an_iteration_the_fault_never_touched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before: transition.Bench.reattempt() started the clock at the agent's delivery stamp and
    stopped it at the first iteration completed after it; a rank takes an injected raise only between
    two micro-batches, so one delivered late in iteration N is raised in N+1, and the figure was the
    rest of the untouched iteration N (a quick run read 0.055 s, under one iteration). Now the clock
    starts at the rank's raise stamp (the incident's ``source_ts``) and stops at an iteration no
    earlier than the incident's ``step``. Here: delivery at T, iteration N done at T+0.03, the rank
    raises in N+1 at T+0.08 and N+1 completes after the reattempt at T+0.33."""
    import transition  # type: ignore[import-not-found,unused-ignore]

    from unicron.kernel.inject import Injection
    from unicron.kernel.types import DetectionMethod, ErrorKind, Incident, Severity

    T, N = 1_000_000.0, 40
    pids = {r: 100 + r for r in range(4)}
    logs = tmp_path / "logs" / transition.TASK
    logs.mkdir(parents=True)
    done = {N - 2: T - 0.37, N - 1: T - 0.17, N: T + 0.03, N + 1: T + 0.33}
    done |= {N + 1 + k: T + 0.33 + 0.2 * k for k in range(1, 8)}
    for r, pid in pids.items():
        (logs / f"rank{r}.log").write_text(
            "".join(f"iteration {it} done {ts:.6f} pid {pid} dp 4\n" for it, ts in sorted(done.items())))
    raised = Incident(incident_id="i1", severity=Severity.SEV3, method=DetectionMethod.EXCEPTION_PROPAGATION,
                      kind=ErrorKind.CONNECTION_REFUSED_RESET, node="node0", message="connection reset",
                      task=transition.TASK, gpu=0, rank=0, step=N + 1, source_ts=T + 0.08,
                      detected_ts=T + 0.09, report_id="r1")

    class Cluster:
        run_dir = str(tmp_path)
        store = object()
        keys = Keyspace("/unicron")

        def running_ranks(self, task: str) -> dict[int, dict[str, Any]]:
            return {r: {"rank": r, "pid": pid, "node": f"node{r // 2}"} for r, pid in pids.items()}

        def wait_for(self, pred: Any, timeout_s: float, what: str, poll_s: float = 0.02) -> Any:
            value = pred()
            assert value, what
            return value

        def incidents(self) -> list[Incident]:
            return [raised]

        def wait_incident(self, pred: Any, timeout_s: float = 30.0, after: float = 0.0) -> Incident:
            assert pred(raised)
            return raised

    def delivered(store: Any, keys: Any, node: str, req: Injection, timeout_s: float = 5.0) -> Injection:
        return Injection.from_dict({**req.to_dict(), "executed_ts": T, "ok": True})

    monkeypatch.setattr(transition, "request", delivered)
    monkeypatch.setattr(transition.Bench, "at_offset", lambda self, name, it=None: N)
    b = transition.Bench(Cluster(), str(tmp_path), 5)  # type: ignore[arg-type,unused-ignore]
    out = b.reattempt()
    assert out["s"] >= 0.25 - 1e-6, (
        f"reattempt_s {out['s']:.3f}: stopped at iteration {N}, which completed before the fault was raised")


def test_scale_a_node_loss_never_reported_is_in_the_percentiles_not_skipped() -> None:
    """Before: bench/scale.py skipped a kill or hang with no incident in 30 s, so p50/p99/max were
    computed without it and the JSON did not say how many faults were injected. Now a miss is inf in
    the percentiles (null in the JSON: the target fails) and counted in ``<key>_missed``."""
    import scale  # type: ignore[import-not-found,unused-ignore]

    out = scale.loss_figures("node_loss", [0.12, math.inf, 0.15])
    assert out["node_loss_n"] == 2 and out["node_loss_missed"] == 1
    assert out["node_loss_p99_s"] is None and out["node_loss_max_s"] is None
    assert out["node_loss_p50_s"] == 0.15
    json.loads(json.dumps(out, allow_nan=False))  # strict JSON: no Infinity


def test_scale_a_false_loss_is_the_fleets_only_when_it_sent_the_node_nothing_for_the_whole_timeout() -> None:
    """bench/scale.py counted every false node loss against the coordinator, also one its own hollow
    fleet could have caused (a shared heartbeat thread starved on a 2-core machine). Now a heartbeat
    timeout is the harness's only when the fleet's stamped send gap spans the whole timeout before it;
    a gap that ended or began within the timeout, or a closed connection, stays the coordinator's."""
    import scale  # type: ignore[import-not-found,unused-ignore]

    def loss(node: str, ts: float, why: str = "agent heartbeat timeout") -> dict[str, Any]:
        return {"event": "incident", "kind": "lost_connection", "node": node, "source_ts": ts, "ts": ts + 0.3,
                "message": why}

    gaps = [("n1", 100.0, 101.5),   # nothing sent to n1 from 100.0 to 101.5: the fleet's silence
            ("n2", 100.5, 101.2),   # n2 fed 0.6 s before its loss: the coordinator's
            ("n3", 99.0, 100.9)]    # n3's gap ended before its loss: the coordinator's
    losses = [loss("n1", 101.2), loss("n2", 101.1), loss("n3", 101.0), loss("n4", 101.0),
              loss("n1", 101.3, "agent connection closed")]
    product, blamed = scale.false_losses(losses, gaps, 1.0)
    assert product == 4
    assert blamed == [{"node": "n1", "fleet_gap_s": 1.5}]


def test_redistribute_delay_is_the_failed_iterations_excess_over_the_jobs_usual_one(tmp_path: Path) -> None:
    """bench/redistribute.py's delay: (end of F - end of F-1) minus the median of the job's earlier
    iterations, with the restart's F-1 read from the killed launch's ``--log-iterations`` lines (the
    dead rank's lines are not the survivors' ends)."""
    import redistribute  # type: ignore[import-not-found,unused-ignore]

    b = redistribute.Bench(redistribute.PROFILES["full"], str(tmp_path), None)  # F = 3
    killed = tmp_path / "first"
    killed.mkdir()
    for r, skew in enumerate((0.0, 0.01, 0.02, 5.0)):  # rank 3 is the dead one: its stamps do not count
        lines = [f"iteration {i} done {10.0 + i * 0.4 + skew:.6f} pid {100 + r} dp 4\n" for i in range(3)]
        (killed / f"rank{r}.1.log").write_text("some other line\n" + "".join(lines))

    class Killed:
        out_dir = str(killed)

    before = redistribute._logged_iteration_ends(Killed())
    assert before == pytest.approx({0: 10.02, 1: 10.42, 2: 10.82})
    # the relaunched job ends iteration 3 1.5 s after the usual end (10.82 + 0.4)
    assert b.delay(before, {3: 12.72}) == pytest.approx(1.5)
    # in place: the same job's ends; a failed iteration as long as the usual one has no delay
    assert b.delay(before | {3: 11.22}, before | {3: 11.22}) == pytest.approx(0.0)
