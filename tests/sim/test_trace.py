"""Failure traces: the file format round-trips, generators are seeded and have the paper's counts."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim import trace as tr
from unicron.kernel.errors import InvalidRecord


def test_round_trip(tmp_path: Path) -> None:
    original = tr.trace_a(seed=7)
    tr.write(original, tmp_path / "a.jsonl")
    back = tr.read(tmp_path / "a.jsonl")
    assert back == original


def test_a_file_without_header_is_read_too(tmp_path: Path) -> None:
    path = tmp_path / "real.jsonl"
    path.write_text('{"time_s": 10, "node": "node003", "gpu": 2, "severity": 1, "kind": "ecc_error", "repair_s": 50}\n'
                    '\n{"time_s": 5, "node": "node001", "gpu": 0, "severity": 3, "kind": "link_flapping"}\n')
    trace = tr.read(path, n_nodes=4)
    assert [f.time_s for f in trace.failures] == [5.0, 10.0]
    assert trace.n_nodes == 4 and trace.duration_s == 60.0


@pytest.mark.parametrize(("line", "field"), [
    ('{"time_s": -1, "node": "n", "gpu": 0, "severity": 1, "kind": "ecc_error"}', "time_s"),
    ('{"time_s": 1, "node": "n", "gpu": 0, "severity": 4, "kind": "ecc_error"}', "severity"),
    ('{"time_s": 1, "node": "n", "gpu": 0, "severity": 2, "kind": "meteor"}', "kind"),
    ('{"time_s": 1, "node": "n", "severity": 2, "kind": "cuda_error"}', "gpu"),
    ('[1, 2]', "expected a JSON object"),
])
def test_bad_records_name_the_field(tmp_path: Path, line: str, field: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(InvalidRecord, match=field):
        tr.read(path)


HEADER = '{"trace": "t", "duration_s": 86400, "n_nodes": 16, "gpus_per_node": 8}\n'


@pytest.mark.parametrize(("text", "message"), [
    (HEADER + '{"time_s": 100, "node": "node099", "gpu": 0, "severity": 1, "kind": "lost_connection"}',
     r"^trace t.jsonl line 2.node: 'node099' is not one of the trace's 16 nodes \(node000..node015\)"),
    (HEADER + '{"time_s": 100, "node": "node003", "gpu": 12, "severity": 2, "kind": "cuda_error"}',
     r"^trace t.jsonl line 2.gpu: 12 is not below the 8 GPUs per node"),
    (HEADER + '{"time_s": 100000, "node": "node003", "gpu": 1, "severity": 1, "kind": "ecc_error"}',
     r"^trace t.jsonl line 2.time_s: 100000 is not before the trace's end \(duration_s 86400\)"),
    (HEADER + '{"time_s": 86400, "node": "node003", "gpu": 1, "severity": 3, "kind": "link_flapping"}',
     r"^trace t.jsonl line 2.time_s: 86400 is not before"),
    ('{"time_s": 100, "node": "gpu-node-3", "gpu": 1, "severity": 2, "kind": "cuda_error"}',
     r"^trace t.jsonl line 1.node: 'gpu-node-3' is not one of the trace's 4 nodes"),
    ('{"trace": "t", "duration_s": 86400, "n_nodes": true}', r"^trace t.jsonl line 1.n_nodes: .* got True$"),
    ('{"trace": "t", "duration_s": 86400, "n_nodes": 0}', r"^trace t.jsonl line 1.n_nodes: .* got 0$"),
    ('{"trace": "t", "duration_s": 86400, "n_nodes": "16"}', r"^trace t.jsonl line 1.n_nodes: .* got '16'$"),
    ('{"trace": "t", "duration_s": 86400, "gpus_per_node": true}', r"^trace t.jsonl line 1.gpus_per_node: "),
])
def test_a_failure_outside_the_cluster_or_the_period_is_refused(tmp_path: Path, text: str, message: str) -> None:
    """The simulation passed over such a failure without a word (counted as on a node down or idle
    GPUs) and still counted it as a failure; a boolean n_nodes was read as 1 node."""
    path = tmp_path / "t.jsonl"
    path.write_text(text + "\n")
    with pytest.raises(InvalidRecord, match=message) as raised:
        tr.read(path)
    assert "\n" not in str(raised.value)


def test_a_file_without_header_is_checked_against_the_cluster_given(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"time_s": 5, "node": "node005", "gpu": 3, "severity": 2, "kind": "cuda_error"}\n')
    with pytest.raises(InvalidRecord, match=r"line 1\.node: 'node005' is not one of the trace's 4 nodes"):
        tr.read(path, n_nodes=4)
    with pytest.raises(InvalidRecord, match=r"line 1\.gpu: 3 is not below the 2 GPUs per node"):
        tr.read(path, n_nodes=8, gpus_per_node=2)
    assert tr.read(path, n_nodes=8).failures[0].node == "node005"


def test_trace_a_counts_and_repairs() -> None:
    trace = tr.trace_a(seed=1)
    assert trace.count(1) == 10 and trace.count(2) + trace.count(3) == 33
    assert trace.duration_s == 8 * tr.WEEK_S
    for f in trace.failures:
        if f.severity == 1:
            assert tr.DAY_S <= f.repair_s <= 7 * tr.DAY_S
        else:
            assert f.repair_s == 0.0
        assert 0 <= f.time_s < trace.duration_s and 0 <= f.gpu < 8


def test_trace_b_counts_and_repairs() -> None:
    trace = tr.trace_b(seed=1)
    assert trace.count(1) == 26 and trace.count(2) + trace.count(3) == 80
    assert trace.duration_s == tr.WEEK_S
    repairs = [f.repair_s for f in trace.failures if f.severity == 1]
    assert all(tr.DAY_S / 20 <= r <= 7 * tr.DAY_S / 20 for r in repairs)


def test_generators_are_seeded() -> None:
    assert tr.trace_a(3) == tr.trace_a(3)
    assert tr.trace_a(3) != tr.trace_a(4)
    assert tr.trace_b(3) == tr.trace_b(3)
    p = tr.poisson(seed=5, n_nodes=64, duration_s=4 * tr.WEEK_S)
    assert p == tr.poisson(seed=5, n_nodes=64, duration_s=4 * tr.WEEK_S)


def test_no_failure_on_a_node_out_of_service() -> None:
    trace = tr.trace_b(seed=2)
    down: dict[str, float] = {}
    for f in trace.failures:
        assert down.get(f.node, 0.0) <= f.time_s
        if f.severity == 1:
            down[f.node] = f.time_s + f.repair_s


def test_poisson_rate() -> None:
    # 512 GPUs for 8 weeks at trace-a's rate: 4 x 43 = 172 failures expected (sd ~13)
    trace = tr.poisson(seed=0, n_nodes=64, duration_s=8 * tr.WEEK_S)
    assert 120 <= len(trace.failures) <= 230
    assert 0.1 < trace.count(1) / len(trace.failures) < 0.4


@pytest.mark.parametrize("text", [
    "",
    "\n\n",
    '{"trace": "t", "duration_s": -5}\n',
    '{"trace": "t", "duration_s": true}\n',
    '{"trace": "t", "duration_s": "a day"}\n',
])
def test_a_trace_that_covers_no_time_is_refused(tmp_path: Path, text: str) -> None:
    """An empty file simulated zero seconds and printed every system's WAF as 0; a header's bad
    ``duration_s`` was ignored for the failures' span. Now both are refused, naming the remedy."""
    path = tmp_path / "t.jsonl"
    path.write_text(text)
    with pytest.raises(InvalidRecord, match=r"covers nothing to simulate.*duration_s"):
        tr.read(path)


def test_a_header_alone_is_a_failure_free_period(tmp_path: Path) -> None:
    path = tmp_path / "calm.jsonl"
    path.write_text('{"trace": "calm", "duration_s": 86400}\n')
    trace = tr.read(path, n_nodes=2)
    assert (trace.name, trace.duration_s, trace.failures) == ("calm", 86400.0, ())
