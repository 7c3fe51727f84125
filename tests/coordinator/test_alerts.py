"""The alert webhook (issue 17 item 5) against a real local HTTP server, and the coordinator's metrics
on their own registries."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from coordinator import decision as d
from coordinator.alerts import AlertMessage, WebhookNotifier
from coordinator.metrics import CoordinatorMetrics
from coordinator.tasks import parse_task_spec
from unicron.kernel.types import DetectionMethod, ErrorKind, Incident, Severity


class Hook(ThreadingHTTPServer):
    def __init__(self, fail_first: int, delay_s: float = 0.0) -> None:
        self.fail_first = fail_first
        self.delay_s = delay_s
        self.received: list[dict[str, Any]] = []
        self.attempts = 0
        self.redirect = False  #: answer a POST to /alerts with a 301 to /alerts/
        self.gets: list[str] = []
        super().__init__(("127.0.0.1", 0), _Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/alerts"


class _Handler(BaseHTTPRequestHandler):
    server: Hook

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.attempts += 1
        time.sleep(self.server.delay_s)
        if self.server.redirect and self.path == "/alerts":
            self.send_response(301)
            self.send_header("Location", "/alerts/")
            self.send_header("Content-Length", "0")
        elif self.server.attempts <= self.server.fail_first:
            self.send_response(503)
        else:
            self.server.received.append(json.loads(body))
            self.send_response(204)
        self.end_headers()

    def do_GET(self) -> None:  # the endpoint's page, as a browser sees it
        self.server.gets.append(self.path)
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def hook(request: pytest.FixtureRequest) -> Iterator[Hook]:
    fail_first, delay_s = getattr(request, "param", (0, 0.0))
    server = Hook(fail_first, delay_s)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def alert(n: int) -> AlertMessage:
    return AlertMessage(alert_id=f"a{n}", message=f"node n{n} isolated: ecc", task=None, node=f"n{n}", ts=1.0,
                        cluster="/unicron")


def wait(pred: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("hook", [(2, 0.0)], indirect=True)
def test_a_failing_webhook_is_retried_until_it_accepts(hook: Hook) -> None:
    failures: list[int] = []
    n = WebhookNotifier(hook.url, retries=3, backoff_s=0.01, on_failure=lambda: failures.append(1)).start()
    try:
        n.send(alert(1))
        wait(lambda: hook.received)
    finally:
        n.stop()
    assert hook.attempts == 3 and failures == []
    assert hook.received == [{"alert_id": "a1", "message": "node n1 isolated: ecc", "task": None, "node": "n1",
                              "ts": 1.0, "cluster": "/unicron"}]


@pytest.mark.parametrize("hook", [(100, 0.0)], indirect=True)
def test_an_alert_the_webhook_never_accepts_is_counted_as_failed(hook: Hook) -> None:
    m = CoordinatorMetrics()
    n = WebhookNotifier(hook.url, retries=2, backoff_s=0.01, on_failure=m.webhook_failures.inc).start()
    try:
        n.send(alert(1))
        wait(lambda: m.registry.get_sample_value("unicron_alert_webhook_failures_total") == 1.0)
    finally:
        n.stop()
    assert hook.attempts == 3  # the first try and two retries


def test_a_webhook_that_redirects_its_post_is_not_counted_as_delivered(hook: Hook) -> None:
    """urllib followed a 301/302/303 answer to the POST with a GET without the body, and that GET's 200
    counted as delivered: a webhook behind a redirect (http -> https, a trailing slash) got no alert
    while the coordinator logged nothing and counted it sent. Now the redirect is a failed attempt."""
    hook.redirect = True
    failures: list[int] = []
    n = WebhookNotifier(hook.url, retries=1, backoff_s=0.01, on_failure=lambda: failures.append(1)).start()
    try:
        n.send(alert(1))
        wait(lambda: failures or n.sent)
    finally:
        n.stop()
    assert (failures, n.sent, hook.attempts, hook.gets) == ([1], 0, 2, [])


@pytest.mark.parametrize("hook", [(0, 0.5)], indirect=True)
def test_send_never_waits_for_a_slow_webhook(hook: Hook) -> None:
    n = WebhookNotifier(hook.url, timeout_s=5.0).start()
    try:
        start = time.monotonic()
        for i in range(5):
            n.send(alert(i))
        assert time.monotonic() - start < 0.1  # five POSTs take 2.5 s; the caller (the decision loop) waits for none
        wait(lambda: len(hook.received) == 5, timeout_s=10.0)
    finally:
        n.stop()
    assert [a["alert_id"] for a in hook.received] == [f"a{i}" for i in range(5)]  # in order


def test_each_coordinator_has_its_own_registry_and_gauges_follow_the_state() -> None:
    a, b = CoordinatorMetrics(), CoordinatorMetrics()  # two daemons in one process: no duplicate-name error
    state = d.CoreState()
    state.nodes["n1"] = d.NodeEntry(8)
    state.nodes["n2"] = d.NodeEntry(8, d.NodeState.ISOLATED)
    spec = parse_task_spec({"name": "job", "command": ["x"]}, None)
    state.tasks["job"] = d.TaskEntry(spec, phase=d.TaskPhase.RUNNING, placement={"n1": [0, 1, 2]})
    a.state(state)
    assert a.registry.get_sample_value("unicron_task_gpus", {"task": "job"}) == 3.0
    assert a.registry.get_sample_value("unicron_nodes", {"state": "isolated"}) == 1.0
    assert a.registry.get_sample_value("unicron_nodes", {"state": "up"}) == 1.0
    assert b.registry.get_sample_value("unicron_task_gpus", {"task": "job"}) is None
    state.tasks["job"].phase = d.TaskPhase.FINISHED
    a.state(state)
    assert a.registry.get_sample_value("unicron_task_gpus", {"task": "job"}) is None  # gone, not left at 3


def test_per_task_recovery_series_do_not_outlive_their_tasks() -> None:
    """unicron_task_recovery_seconds_total{task} got a series for every task that ever had an incident
    and none was ever removed (task_gpus and the planned gauges were): a leader that ran for weeks
    through thousands of uniquely named jobs exported one series per name it ever saw. Now a task's
    series goes when the task leaves the active phases, as its task_gpus does."""
    m = CoordinatorMetrics()
    for task in ["job", *(f"job-{i}" for i in range(300))]:  # short jobs, each hit by one failure
        m.incident(Incident(incident_id=f"i-{task}", severity=Severity.SEV2, method=DetectionMethod.PROCESS_SUPERVISION,
                            kind=ErrorKind.EXITED_ABNORMALLY, node="n1", message="", task=task, gpu=None, rank=0,
                            step=1, source_ts=0.0, detected_ts=0.5, report_id=f"r-{task}", detection_s=0.5,
                            action="restart", tasks=[task]))
    state = d.CoreState()  # every job-i finished or was cancelled; "job" still runs
    spec = parse_task_spec({"name": "job", "command": ["x"]}, None)
    state.tasks["job"] = d.TaskEntry(spec, phase=d.TaskPhase.RUNNING, placement={"n1": [0]})
    m.state(state)
    live = {s.labels["task"] for f in m.registry.collect() if f.name == "unicron_task_recovery_seconds"
            for s in f.samples if s.name.endswith("_total")}
    assert live == {"job"}


def test_a_tasks_planned_figures_go_when_it_leaves_the_active_phases() -> None:
    """Cancelling the only modelled task made no new plan, and its modelled FLOP/s and WAF stayed on the
    dashboard; they now go with the task, as its task_gpus does."""
    m = CoordinatorMetrics()
    m.planned({"m1": 1.78e13, "m2": 2e13}, {"m1": 1.78e13, "m2": 4e13})
    state = d.CoreState()
    spec = parse_task_spec({"name": "m2", "command": ["x"]}, None)
    state.tasks["m2"] = d.TaskEntry(spec, phase=d.TaskPhase.RUNNING, placement={"n1": [0]})
    m.state(state)  # m1 cancelled
    assert m.registry.get_sample_value("unicron_task_planned_flops", {"task": "m1"}) is None
    assert m.registry.get_sample_value("unicron_task_planned_waf", {"task": "m1"}) is None
    assert m.registry.get_sample_value("unicron_task_planned_waf", {"task": "m2"}) == 4e13
