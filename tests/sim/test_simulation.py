"""The simulator drives the real decision core: a sev1 isolates a node and the task is re-planned;
Megatron loses more work than Unicron on the same trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coordinator import decision as d
from sim import trace as tr
from sim.costs import CostSettings
from sim.run import simulate
from sim.unicron import UnicronSim
from sim.workload import case
from unicron.cli.main import main
from unicron.kernel.errors import ConfigError

DAY = tr.DAY_S


def one_failure(node: str, severity: int, kind: str, gpu: int = 0, repair_s: float = 0.0) -> tr.Trace:
    failure = tr.Failure(3600.0, node, gpu, severity, kind, repair_s)
    return tr.Trace("one", 3 * DAY, 16, 8, (failure,))


def node_of(sim: UnicronSim, task: str) -> str:
    return sorted(sim.placement()[task])[0]


def biggest_task() -> tuple[str, str]:
    probe = UnicronSim(case(5), one_failure("node000", 3, "link_flapping"), CostSettings())
    probe.setup()
    placement = probe.placement()
    task = max(placement, key=lambda t: sum(placement[t].values()))
    return task, node_of(probe, task)


def assigns(sim: UnicronSim, task: str) -> list[d.Assign | d.ResizeInPlace]:
    """The task's plans: its launch, then each re-plan (a new generation, or an in-place resize when a
    complete replica survives, as it does when a node of a big task is lost)."""
    return [a for a in sim.actions_log if isinstance(a, d.Assign | d.ResizeInPlace) and a.task == task]


def gpus(plan: d.Assign | d.ResizeInPlace) -> int:
    return sum(len(r) for r in plan.placement.values())


def test_sev1_isolates_the_node_and_the_core_replans_the_task() -> None:
    task, node = biggest_task()
    sim = UnicronSim(case(5), one_failure(node, 1, "ecc_error", repair_s=DAY), CostSettings())
    result = sim.run()
    isolations = [a for a in sim.actions_log if isinstance(a, d.IsolateNode)]
    assert [a.node for a in isolations] == [node]
    plans = assigns(sim, task)
    assert len(plans) >= 3  # launch, the re-plan without the node, the re-plan with it back
    without = plans[1]
    assert node not in without.placement
    assert gpus(without) < gpus(plans[0])
    # the repair (NodeUndrained) returns the node, and the plan is whole again at the end
    assert sim.state.nodes[node].status is d.NodeState.UP
    assert result.available_gpus[-1] == 128
    assert sim.cluster_waf() == pytest.approx(result.ideal / result.duration_s)
    # the loss was charged: detection, transition and a sub-healthy day
    assert result.lost_detection > 0 and result.lost_transition > 0 and result.lost_sub_healthy > 0


def test_a_lost_node_is_isolated_as_the_daemon_does_and_rejoins() -> None:
    """The daemon records a node-health report for a lost agent and raises its sev1 incident."""
    task, node = biggest_task()
    sim = UnicronSim(case(5), one_failure(node, 1, "lost_connection", repair_s=DAY), CostSettings())
    sim.run()
    assert [a.node for a in sim.actions_log if isinstance(a, d.IsolateNode)] == [node]
    assert node not in assigns(sim, task)[1].placement
    assert sim.state.nodes[node].status is d.NodeState.UP


def test_sev2_restarts_ranks_in_place_without_a_new_plan() -> None:
    task, node = biggest_task()
    sim = UnicronSim(case(5), one_failure(node, 2, "cuda_error", gpu=0), CostSettings())
    sim.run()
    restarts = [a for a in sim.actions_log if isinstance(a, d.RestartRanks)]
    assert len(restarts) == 1 and restarts[0].node == node
    assert len(assigns(sim, task)) == 1  # only the launch
    assert sim.state.tasks[restarts[0].task].phase is d.TaskPhase.RUNNING


@pytest.mark.parametrize(("kind", "repair_s"), [("ecc_error", 0.0), ("lost_connection", 0.5)])
def test_a_node_repaired_before_detection_is_back_after_it(kind: str, repair_s: float) -> None:
    """The repair came first (the node still up: a no-op NodeJoined), then detection isolated the node
    and nothing undrained it: a 0-second outage cost a node for the rest of the run."""
    _, node = biggest_task()
    trace = one_failure(node, 1, kind, repair_s=repair_s)
    sim = UnicronSim(case(5), trace, CostSettings())
    uni = sim.run()
    meg = simulate(trace, case(5), ["megatron"])["megatron"]
    assert [a.node for a in sim.actions_log if isinstance(a, d.IsolateNode)] == [node]  # still detected
    assert sim.state.nodes[node].status is d.NodeState.UP and uni.available_gpus[-1] == 128
    assert uni.accumulated / uni.ideal >= meg.accumulated / meg.ideal
    assert uni.lost_sub_healthy < 1e-6 * uni.ideal


@pytest.mark.parametrize("seed", [0, 1])
def test_megatron_loses_more_work_than_unicron(seed: int) -> None:
    results = simulate(tr.trace_a(seed), case(5), ["unicron", "megatron"])
    uni, meg = results["unicron"], results["megatron"]
    assert uni.ideal == pytest.approx(meg.ideal)  # same initial plan
    assert uni.accumulated > meg.accumulated
    assert meg.lost_detection + meg.lost_transition > 10 * (uni.lost_detection + uni.lost_transition)


def test_cost_overrides_change_the_outcome() -> None:
    trace = tr.trace_b(0)
    base = simulate(trace, case(5), ["megatron"])["megatron"]
    cheap = CostSettings().with_overrides(["megatron_timeout_s=0", "megatron_restart_s=0"])
    better = simulate(trace, case(5), ["megatron"], cheap)["megatron"]
    assert better.accumulated > base.accumulated
    with pytest.raises(ConfigError, match="megatron_typo"):
        CostSettings().with_overrides(["megatron_typo=1"])


def test_cli_writes_figure_and_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["simulate", "--trace", "trace-b", "--systems", "unicron,megatron", "--out", str(tmp_path),
               "--seed", "2", "--quiet", "--save-trace"])
    assert rc == 0
    assert (tmp_path / "figure11_trace-b.png").stat().st_size > 10_000
    assert (tmp_path / "summary.json").exists() and (tmp_path / "trace.jsonl").exists()
    assert "waf_vs_megatron" in capsys.readouterr().out
    # the saved trace replays to the same result
    rc = main(["simulate", "--trace", str(tmp_path / "trace.jsonl"), "--systems", "unicron,megatron",
               "--out", str(tmp_path / "again"), "--quiet"])
    assert rc == 0
    first = json.loads((tmp_path / "summary.json").read_text())["traces"]["trace-b"]["ratios"]
    again = json.loads((tmp_path / "again" / "summary.json").read_text())["traces"]["trace-b"]["ratios"]
    assert first == again and first["waf_vs_megatron"] > 1


def test_cli_bad_input_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["simulate", "--systems", "unicron,slurm", "--out", str(tmp_path), "--quiet"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--systems" in err
    assert main(["simulate", "--cost", "nonsense", "--out", str(tmp_path)]) == 1
    assert "--cost" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert main(["simulate", "--out", str(tmp_path / "file" / "out"), "--quiet"]) == 1  # was a traceback
    err = capsys.readouterr().err
    assert err == f"unicron simulate: --out: cannot create {tmp_path / 'file' / 'out'} (Not a directory); pick another directory\n"
    (tmp_path / "binary.jsonl").write_bytes(b"\xff\xfe\x00binary")  # was a UnicodeDecodeError traceback
    assert main(["simulate", "--trace", str(tmp_path / "binary.jsonl"), "--out", str(tmp_path), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not UTF-8 text (byte 0xff at offset 0)" in err
    with pytest.raises(SystemExit) as exited:  # was numpy's ValueError, after --out had been created
        main(["simulate", "--seed", "-1", "--out", str(tmp_path / "never"), "--quiet"])
    assert exited.value.code == 2 and "argument --seed: '-1'" in capsys.readouterr().err
    assert not (tmp_path / "never").exists()


def test_a_bad_workload_or_trace_name_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """'case²' passed str.isdigit() and failed int(); 'case' + 5,000 digits passed it and hit int()'s
    4,300-digit limit; a name past the system's NAME_MAX failed Path.exists(): three tracebacks."""
    for flag, spec, message in (("--workload", "case\u00b2", "is neither case1..case5 nor an existing file"),
                                ("--workload", "case" + "1" * 5000, "'case11111111111111111111'... is not a Table 3 case"),
                                ("--workload", "case9", "case9 is not a Table 3 case"),
                                ("--workload", "x" * 5000, "'xxxx"),  # the CLI cuts the line
                                ("--trace", "x" * 5000, "'xxxx")):
        assert main(["simulate", flag, spec, "--out", str(tmp_path), "--quiet"]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"unicron simulate: {flag}: ") and err.count("\n") == 1 and message in err


def test_cli_refuses_a_failure_off_the_cluster(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """It ran, printing efficiency 1.000 for a failure on node099 of a 16-node trace."""
    (tmp_path / "t.jsonl").write_text(
        '{"trace": "t", "duration_s": 86400, "n_nodes": 16, "gpus_per_node": 8}\n'
        '{"time_s": 100, "node": "node099", "gpu": 0, "severity": 1, "kind": "lost_connection", "repair_s": 500}\n')
    assert main(["simulate", "--trace", str(tmp_path / "t.jsonl"), "--workload", "case5",
                 "--out", str(tmp_path / "o"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("unicron simulate: trace t.jsonl line 2.node: 'node099' is not one of") and err.count("\n") == 1
    (tmp_path / "w.json").write_text(json.dumps({"n_nodes": True, "tasks": [{"name": "x"}]}))
    assert main(["simulate", "--workload", str(tmp_path / "w.json"), "--out", str(tmp_path / "o"), "--quiet"]) == 1
    assert "workload.n_nodes: expected a positive integer, got True" in capsys.readouterr().err


def test_workload_and_trace_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = {"num_layers": 24, "hidden_size": 2048, "num_attention_heads": 16, "seq_length": 2048,
             "vocab_size": 51200, "global_batch_size": 512, "micro_batch_size": 2}
    tasks = [{"name": "small", "command": ["train"], "weight": 2.0, "model": model},
             {"name": "other", "command": ["train"], "tp_size": 2, "min_gpus": 2, "model": model}]
    (tmp_path / "w.json").write_text(json.dumps({"n_nodes": 4, "tasks": tasks}))
    tr.write(tr.poisson(seed=1, n_nodes=4, duration_s=2 * tr.WEEK_S, rate_per_gpu_hour=1e-3), tmp_path / "t.jsonl")
    rc = main(["simulate", "--trace", str(tmp_path / "t.jsonl"), "--workload", str(tmp_path / "w.json"),
               "--systems", "unicron,megatron", "--out", str(tmp_path / "o"), "--quiet"])
    assert rc == 0
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["workload"] == "w"
    tasks[1]["weight"] = 9
    (tmp_path / "w.json").write_text(json.dumps({"n_nodes": 4, "tasks": tasks}))
    assert main(["simulate", "--workload", str(tmp_path / "w.json"), "--out", str(tmp_path), "--quiet"]) == 1
    assert "task.weight" in capsys.readouterr().err
