"""``unicron plan``: the example input, JSON output, clear errors, and the Figure 4 plot."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from plans.cli import main

EXAMPLE = Path(__file__).parents[2] / "plans" / "examples" / "table3_case5.json"


def _write(tmp_path: Path, doc: Any) -> str:
    path = tmp_path / "input.json"
    path.write_text(json.dumps(doc))
    return str(path)


def _doc(**task: Any) -> dict[str, Any]:
    return {
        "cluster": {"gpu_type": "A800-80GB", "n_gpus": 64},
        "tasks": [{"name": "a", "model": "7B", **task}, {"name": "b", "model": "1.3B"}],
    }


def test_example_prints_allocation_configs_and_objective(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--input", str(EXAMPLE)]) == 0
    out = capsys.readouterr().out
    assert "objective sum G" in out
    for name in ("task1", "task6"):
        assert name in out
    assert "TP" in out and "PP" in out and "DP" in out


def test_json_output_is_complete_and_consistent(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--input", str(EXAMPLE), "--json", "--planner", "all"]) == 0
    doc = json.loads(capsys.readouterr().out)
    plans = {p["planner"]: p for p in doc["plans"]}
    assert set(plans) == {"unicron", "equally", "weighted", "sized"}
    for p in plans.values():
        assert p["used_gpus"] <= p["n_gpus"] == 128
        assert p["objective"] == pytest.approx(sum(t["gain"] for t in p["tasks"].values()))
        for t in p["tasks"].values():
            cfg = t["config"]
            if t["gpus"] and t["waf"] > 0:
                assert cfg["tp"] * cfg["pp"] * cfg["dp"] == t["gpus"]
    assert all(plans["unicron"]["total_waf"] >= p["total_waf"] for p in plans.values())


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"cluster": {"gpu_type": "A800", "n_gpus": -8}, "tasks": []}, "cluster.n_gpus: must be >= 0"),
        (
            {"cluster": {"gpu_type": "A800", "n_gpus": 12.5}, "tasks": []},
            "cluster.n_gpus: expected an integer",
        ),
        ({"cluster": {"gpu_type": "V100", "n_gpus": 8}, "tasks": []}, "unknown GPU type 'V100'"),
        # a numpy "Maximum allowed dimension exceeded" traceback before
        ({"cluster": {"gpu_type": "A800", "n_gpus": 10**100}, "tasks": []}, "cluster.n_gpus: must be at most"),
        (_doc(min_gpus=-1), r"task\[a\].min_gpus: must be >= 0"),
        (_doc(current_gpus="8"), r"task\[a\].current_gpus: expected an integer"),
        (_doc(weight=0), r"task\[a\].weight: must be a finite number > 0"),
        (_doc(colour="red"), r"tasks\[0\]: unknown field"),
        (_doc(model="3B"), "unknown preset '3B'"),
        (_doc(model={"layers": 2}), r"tasks\[0\].model: missing field"),
        (_doc(min_gpus=56), "'a' needs 64, 'b' needs 1"),
        (
            {**_doc(model="175B"), "cluster": {"gpu_type": "a800", "n_gpus": 32}},
            "task 'a' .175B, min_gpus=1.: needs at least 48 GPUs to run; the cluster has 32",
        ),
    ],
)
def test_invalid_input_gets_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], doc: Any, message: str
) -> None:
    assert main(["plan", "--input", _write(tmp_path, doc)]) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    assert captured.err.startswith("unicron plan: error: ")
    assert re.search(message, captured.err), captured.err


@pytest.mark.parametrize(
    ("a", "b", "reliability", "message"),
    [
        ({"current_gpus": 8, "transition_s": 1e300}, {}, {}, r"task\[a\]: its reward G overflows a float"),
        ({"weight": 1e300}, {}, {}, r"task\[a\]: its reward G overflows"),
        ({}, {}, {"gpu_failure_rate_per_hour": 1e-320}, r"task\[a\]: .*D_running=inf s"),
        # two rewards that each fit in a float, but not their sum
        ({"weight": 3e286, "model": "1.3B"}, {"weight": 3e286}, {}, "tasks: their rewards G together overflow"),
    ],
    ids=["huge-transition", "huge-weight", "tiny-failure-rate", "huge-sum"],
)
def test_numbers_that_overflow_the_reward_get_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], a: Any, b: Any, reliability: Any, message: str
) -> None:
    """Finite inputs the spec accepts made a reward inf (or inf * 0 = NaN), and the programme's traceback
    failed with an IndexError. Now the planner refuses them with one line."""
    doc = {**_doc(**a), "reliability": reliability}
    doc["tasks"][1].update(b)
    assert main(["plan", "--input", _write(tmp_path, doc)]) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    assert re.search(message, captured.err), captured.err


def test_unmet_minimums_can_be_planned_anyway(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, _doc(min_gpus=56))
    assert main(["plan", "--input", path, "--allow-unmet", "--json"]) == 0
    tasks = json.loads(capsys.readouterr().out)["plans"][0]["tasks"]
    assert tasks["a"]["gpus"] in (0, 64)


def test_missing_file_and_missing_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--input", "/nonexistent/x.json"]) == 2
    assert "cannot read" in capsys.readouterr().err
    assert main(["plan"]) == 2
    assert "--input FILE or --plot-throughput" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"cluster": {"gpu_type": "A800", "n_gpus": 8}, "tasks": [{"name": "caf\xe9", "model": "1.3B"}]}'
         .encode("latin-1"), "not UTF-8 text .byte 0xe9"),
        (b"[" * 100_000, "nested deeper than 8 levels"),
        (b'{"cluster": {"gpu_type": "A800", "n_gpus": ' + b"9" * 5000 + b'}, "tasks": []}',
         "not a usable JSON number"),
        (b'{"cluster": ', "not valid JSON: Expecting value at line 1 column 13"),
    ],
    ids=["latin1", "deep", "bigint", "truncated"],
)
def test_a_file_that_is_not_json_text_gets_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, message: str
) -> None:
    """Before: a file that was not UTF-8, nested 100,000 deep or held an integer over 4300 digits was a
    traceback (UnicodeDecodeError, RecursionError, ValueError). Now: one line naming the file."""
    path = tmp_path / "in.json"
    path.write_bytes(content)
    assert main(["plan", "--input", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"unicron plan: error: --input {path}: ") and err.count("\n") == 1, err
    assert re.search(message, err), err


def test_plot_throughput_writes_a_png(tmp_path: Path) -> None:
    out = tmp_path / "fig4.png"
    assert main(["plan", "--plot-throughput", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
