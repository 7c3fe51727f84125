"""The runtime on a GPU (marked ``gpu``: skipped without one). The model, its gradients and every
collective's tensors live on the rank's GPU (``--device cuda``, the default with ``--backend nccl``).

One GPU is enough for what is checked here: a rank training with NCCL, and two ranks on the same GPU
with gloo (which moves CUDA tensors; NCCL refuses two ranks on one GPU) surviving a SIGKILL and a
rejoin. The reference is the same job on the CPU: in float64 the GPU must agree to rounding.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import pytest

from tests.runtime.conftest import Runner, train_args, wait_for
from unicron.cluster.launch import LocalJob
from unicron.runtime.compare import bitwise_equal, max_rel_diff

pytestmark = pytest.mark.gpu

#: GPU against CPU, float64, a few Adam steps: rounding differences (cuBLAS vs CPU BLAS order)
CPU_TOLERANCE = 1e-9
NCCL = ["--backend", "nccl"]
GLOO_ON_GPU = ["--backend", "gloo", "--device", "cuda"]
ONE_GPU = {r: {"LOCAL_RANK": "0"} for r in range(2)}  # both ranks on GPU 0


def test_a_rank_trains_on_its_gpu_with_nccl_and_matches_the_cpu(runner: Runner) -> None:
    args = train_args(3, "float64", False)
    done = runner.run(1, [*args, *NCCL, "--blocks", "4"])
    assert done.codes == {0: 0}, done.job.logs()
    assert done.result(0)["device"] == "cuda:0"
    diff = max_rel_diff(done.params(0), runner.reference(args))
    print(f"nccl, 1 rank: GPU vs CPU max rel diff {diff:.3e}")
    assert diff <= CPU_TOLERANCE, f"GPU vs CPU: max rel diff {diff:.3e}"


def test_a_gpu_rank_killed_mid_iteration_is_redistributed_then_rejoins(runner: Runner) -> None:
    """Rank 1 dies in iteration 1 after one micro-batch: rank 0 finishes the iteration with the orphaned
    micro-batches (exact gradient); the restarted rank rejoins and receives the state on the GPU."""
    args = train_args(0, "float64", False, "--iter-sleep", "0.05", *GLOO_ON_GPU)

    def rejoin_then_stop(job: LocalJob) -> None:
        wait_for(lambda: any(1 in e.members and e.incarnations.get(1) == 2 for e in job.epochs()),
                 90, "rank 1 to rejoin")
        time.sleep(1.0)
        job.set_key("stop", "1")

    done = runner.run(2, args, faults={1: "die@1:mb1"}, restart={1: 0.3}, env=ONE_GPU,
                      while_running=rejoin_then_stop)
    assert all(c == 0 for c in done.codes.values()), done.job.logs()
    failures = [e for e in done.events(0, "regroup") if e["reason"] == "failure"]
    assert [(e["it"], e["members"]) for e in failures] == [(1, [0])]
    assert done.result(1, incarnation=2)["device"] == "cuda:0"
    iterations = done.result(0)["iterations"]
    reference = runner.reference(train_args(iterations, "float64", False), world=1, blocks=2)
    diff = max_rel_diff(done.params(0), reference)
    print(f"gloo on GPU, kill + rejoin, {iterations} iterations: GPU vs CPU max rel diff {diff:.3e}")
    assert diff <= CPU_TOLERANCE, f"GPU after a failure vs CPU without: max rel diff {diff:.3e}"
    assert bitwise_equal(done.params(1, incarnation=2), done.params(0)), "the rejoined replica differs"


@pytest.mark.parametrize("where", ["shm", "disk"])
def test_a_gpu_task_resumes_from_its_memory_snapshot(runner: Runner, tmp_path: Path, where: str) -> None:
    """Snapshots of GPU state go to the rank's shared-memory slots (page-locked on tmpfs, copied
    unpinned elsewhere) and come back into the GPU: 3 + 2 iterations equal 5 in one run."""
    root = Path(tempfile.mkdtemp(dir="/dev/shm")) if where == "shm" else tmp_path / "ck"
    try:
        ckpt = ["--ckpt", "memory", "--ckpt-dir", str(root), "--ckpt-every", "1", "--resume", *NCCL]
        first = runner.run(1, train_args(3, "float64", False, *ckpt))
        assert first.codes == {0: 0}, first.job.logs()
        second = runner.run(1, train_args(5, "float64", False, *ckpt))
        assert second.codes == {0: 0}, second.job.logs()
        assert [e["it"] for e in second.events(0, "restored")] == [3]
        straight = runner.run(1, train_args(5, "float64", False, *NCCL))
        assert straight.codes == {0: 0}, straight.job.logs()
        diff = max_rel_diff(second.params(0), straight.params(0))
        print(f"memory snapshot in {where}: resumed vs straight max rel diff {diff:.3e}")
        assert diff <= 1e-12, f"resumed vs straight on the GPU: max rel diff {diff:.3e}"
    finally:
        if where == "shm":
            shutil.rmtree(root, ignore_errors=True)
