"""The in-place API (``unicron.runtime.pretrain``) with a model that is not our GPT: the plain PyTorch MLP
of ``examples/pretrain_mlp.py``, run as the example file itself on 4 real ranks (gloo), through the same
failures as the GPT in ``test_failures.py``: ranks SIGKILLed before the all-reduce at several positions,
and during it (after two of four gradient buckets were reduced), then two deaths in one iteration.
The survivors' parameters must equal a failure-free run's: float64 within 1e-12 relative (default
mode), bit for bit in deterministic mode."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from tests.runtime.conftest import COMM, Runner
from tests.runtime.test_failures import assert_exact, failure_regroups
from unicron.kernel.errors import ConfigError
from unicron.runtime.api import Providers, make_parser, training_data
from unicron.runtime.comm import solo_group
from unicron.runtime.job import Job, grad_dtype
from unicron.runtime.scheduler import ScheduleConfig

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "pretrain_mlp.py")
#: 5,508 parameters: four gradient buckets of 1,500 elements
MLP = ["--features", "16", "--width", "64", "--depth", "2", "--outputs", "4", "--dtype", "float64"]
BATCH = ["--global-batch-size", "32", "--micro-batch-size", "4", "--bucket-elems", "1500", "--lr", "0.01"]


def mlp_args(iterations: int, deterministic: bool = False) -> list[str]:
    args = [*MLP, *BATCH, *COMM, "--iterations", str(iterations)]
    return [*args, "--deterministic"] if deterministic else args


def test_mlp_kill_before_allreduce_at_several_positions(runner: Runner) -> None:
    args = mlp_args(5)
    faults = {3: "die@1:mb0", 2: "die@2:mb1", 1: "die@3:bucket0"}
    done = runner.run(4, args, faults=faults, script=EXAMPLE)
    assert done.codes == {0: 0, 1: -9, 2: -9, 3: -9}, done.job.logs()
    regroups = failure_regroups(done, 0)
    assert [(e["it"], e["members"]) for e in regroups] == [(1, [0, 1, 2]), (2, [0, 1]), (3, [0])]
    assert [e["dp"] for e in done.events(0, "iteration")] == [4, 3, 2, 1, 1]
    assert_exact(done.params(0), runner.reference(args, script=EXAMPLE), False, "float64")


@pytest.mark.parametrize("deterministic", [False, True], ids=["default-fp64", "deterministic-fp64"])
def test_mlp_kill_during_allreduce_then_two_failures_in_one_iteration(runner: Runner, deterministic: bool) -> None:
    args = mlp_args(4, deterministic)
    faults = {2: "die@1:bucket2", 3: "die@2:mb1", 0: "die@2:mb3"}
    done = runner.run(4, args, faults=faults, script=EXAMPLE)
    assert done.codes == {0: -9, 1: 0, 2: -9, 3: -9}, done.job.logs()
    regroups = failure_regroups(done, 1)
    assert [(e["it"], e["members"]) for e in regroups] == [(1, [0, 1, 3]), (2, [0, 1]), (2, [1])]
    assert regroups[0]["kept_buckets"] == 2, "the two buckets reduced before the death must be kept"
    assert_exact(done.params(1), runner.reference(args, script=EXAMPLE), deterministic, "float64")


# --- the API's checks, in one process ----------------------------------------------------------------

class _Data:
    def batch(self, iteration: int, mb: int) -> torch.Tensor:
        return torch.full((2, 3), float(iteration * 10 + mb), dtype=torch.float64)


def _job(forward: object, model: object = None) -> Job[torch.Tensor]:
    def provider(ctx: object) -> object:
        return torch.nn.Linear(3, 1).double() if model is None else model

    return Job(model_provider=provider, forward_step=forward, data=_Data())  # type: ignore[arg-type]


def test_the_job_builds_equal_replicas_and_checks_what_the_user_returns() -> None:
    job = _job(lambda batch, m: m(batch).pow(2).mean())
    a, b = job.build_model(solo_group()), job.build_model(solo_group())
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))  # init seed
    assert job.loss(a, 2, 1).dim() == 0
    with pytest.raises(ConfigError, match=r"scalar tensor with a graph.*shape \(2, 1\)"):
        _job(lambda batch, m: m(batch)).loss(a, 0, 0)
    with pytest.raises(ConfigError, match="got float"):
        _job(lambda batch, m: 1.0).loss(a, 0, 0)
    with pytest.raises(ConfigError, match=r"must return a torch\.nn\.Module"):
        _job(lambda batch, m: m(batch).sum(), model="not a model").build_model(solo_group())
    mixed = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1).double())
    with pytest.raises(ConfigError, match="mix dtypes"):
        grad_dtype(list(mixed.parameters()))


def test_the_datasets_provider_returns_micro_batches_or_megatrons_triple() -> None:
    sched = ScheduleConfig(micro_batches=8, micro_batch_size=2)
    args = argparse.Namespace(tp=1)
    data = _Data()

    def provider(result: object) -> Providers[torch.Tensor]:
        return Providers(lambda ctx: result, lambda ctx: torch.nn.Linear(1, 1), lambda b, m: m(b).sum())  # type: ignore[arg-type,return-value]

    assert training_data(provider(data).datasets, args, sched) is data
    assert training_data(provider((data, None, None)).datasets, args, sched) is data
    with pytest.raises(ConfigError, match="validation and test sets are not run"):
        training_data(provider((data, data, None)).datasets, args, sched)
    with pytest.raises(ConfigError, match="must have batch"):
        training_data(provider([1, 2]).datasets, args, sched)


def test_the_command_line_is_the_runtimes_flags_the_jobs_own_and_megatron_style_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def extra(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        parser.add_argument("--width", type=int, default=8)
        return parser

    defaults = {"global_batch_size": 48, "width": 16}
    args = make_parser(extra, defaults).parse_args(["--micro-batch-size", "2"])
    assert (args.global_batch_size, args.micro_batch_size, args.width, args.iterations) == (48, 2, 16, 10)
    monkeypatch.setenv("UNICRON_TRAIN_GLOBAL_BATCH_SIZE", "96")  # the variable wins over args_defaults
    assert make_parser(extra, defaults).parse_args([]).global_batch_size == 96
    assert make_parser(extra, defaults).parse_args(["--global-batch-size", "8"]).global_batch_size == 8
