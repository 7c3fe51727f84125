"""A stock torchrun script's whole-job restart under Unicron against torchrun itself, and hang
detection from Megatron-LM's own log lines (issue #14's benchmark).

**Restart.** ``examples/stock_gloo_ckpt.py`` (2 ranks, gloo, a checkpoint every ``CKPT_INTERVAL``
steps in a directory on this machine's disk) runs

- under Unicron: ``unicron submit`` with ``"recovery": "restart"`` to a real coordinator and one agent
  with 2 (simulated) GPUs, the production daemons with their default settings (``LocalCluster``);
- under torchrun: ``python -m torch.distributed.run --standalone --nproc-per-node=2 --max-restarts=3``
  (torch's defaults otherwise, e.g. its 0.1 s monitor interval) with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
  (without it torch 2.13's restarts of this job can fail: ``TORCHRUN_ENV`` says why).

Ours starts a rank by forking it from the agent's warm spawner (``agent/prefork.py``: torch already
imported); ``restart_job_cold_s`` (full runs, ``--only cold``) is the same daemons with the spawner off,
every rank a new interpreter as under torchrun.

Each repetition starts a fresh job (its own checkpoint directory) in both, waits for the line of a
checkpointing step after warm-up, waits ``FAULT_OFFSET_S`` more and SIGKILLs rank 1. The figure is
the time from that kill to the job's next completed iteration: for each rank the ``time.time()`` the
script prints with its first step line after its restart (``restart_count`` >= 1), the later of the
two ranks. The two launchers alternate, repetition by repetition, in the same run.

**Hang from log lines.** ``examples/megatron_log.py`` prints Megatron-LM's ``iteration N/ M | ...``
line every iteration (``D_ITER_S``, nothing Unicron-specific in the job). Once hang detection is armed,
the benchmark SIGSTOPs it right after a line appears (the worst phase: the longest wait) and takes
``(incident.detected_ts - stop time) / D_iter``, the coordinator's record of a ``task_hang``.

    .venv/bin/python bench/jobs.py [--quick]

The last line is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from contextlib import redirect_stdout
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from unicron.cli.main import main as cli  # noqa: E402
from unicron.cluster.localcluster import LocalCluster  # noqa: E402
from unicron.kernel.types import ErrorKind  # noqa: E402

SCRIPT = ROOT / "examples" / "stock_gloo_ckpt.py"
MEGATRON_LOG = ROOT / "examples" / "megatron_log.py"
WORLD = 2
STEPS = 400  # more than a repetition runs: the job is stopped once it has recovered
STEP_TIME_S = 0.1
CKPT_INTERVAL = 5
WARM_STEPS = 5  # the fault comes after the first checkpoint at or after this step
FAULT_OFFSET_S = 0.25  # after the checkpointing step's line
D_ITER_S = 0.3
# torch 2.13's c10d rendezvous shares one TCPStore across restarts by default and env:// with
# TORCHELASTIC_USE_AGENT_STORE adds no per-attempt prefix, so a restarted gloo job can read the previous
# attempt's addresses and fail to connect (seen here: all 3 restarts of a run failed). torch's own
# opt-out gives each attempt a store on rank 0, fresh: the baseline in its working configuration.
TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
START = re.compile(r"^start rank (\d+) pid (\d+) restart_count (\d+) resume_step (\d+)$")
STEP = re.compile(r"^step (\d+) rank (\d+)/\d+ loss \S+ time (\d+\.\d+)$")


def wait_for(pred: Callable[[], object], timeout_s: float, what: str, poll_s: float = 0.01) -> object:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := pred():
            return value
        time.sleep(poll_s)
    raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")


class Run:
    """One job's output lines (from any number of files), parsed."""

    def __init__(self, paths: Callable[[], Iterable[Path]]) -> None:
        self.paths = paths

    def lines(self) -> list[str]:
        out: list[str] = []
        for p in self.paths():
            with contextlib.suppress(FileNotFoundError):
                out += p.read_text(errors="replace").splitlines()
        return out

    def pids(self, restart_count: int = 0) -> dict[int, int]:
        """rank -> pid of the ranks started as attempt ``restart_count``."""
        return {int(m[1]): int(m[2]) for line in self.lines()
                if (m := START.match(line)) and int(m[3]) == restart_count}

    def checkpoint_step_line(self) -> int | None:
        """The newest checkpointing step (>= WARM_STEPS) whose line rank 0 printed, if any."""
        done = [int(m[1]) for line in self.lines() if (m := STEP.match(line)) and m[2] == "0"]
        ckpt = [s for s in done if s >= WARM_STEPS and (s + 1) % CKPT_INTERVAL == 0]
        return ckpt[-1] if ckpt else None

    def first_step_after_restart(self) -> float | None:
        """The later of the ranks' first step times in their restarted attempt; None until both have one."""
        first: dict[int, float] = {}
        restarted: set[int] = set()
        for line in self.lines():
            if (m := START.match(line)) and int(m[3]) >= 1:
                restarted.add(int(m[1]))
            elif (m := STEP.match(line)) and int(m[2]) in restarted:
                first.setdefault(int(m[2]), float(m[3]))
        return max(first.values()) if len(first) == WORLD else None


def kill_after_checkpoint(run: Run, timeout_s: float) -> float:
    """SIGKILL rank 1 FAULT_OFFSET_S after a checkpointing step's line; the kill's time.time()."""
    wait_for(lambda: len(run.pids()) == WORLD and run.checkpoint_step_line() is not None, timeout_s,
             "a checkpoint after warm-up")
    time.sleep(FAULT_OFFSET_S)
    victim = run.pids()[1]
    t0 = time.time()
    os.kill(victim, signal.SIGKILL)
    return t0


def script_args(ckpt: Path) -> list[str]:
    return [str(SCRIPT), "--steps", str(STEPS), "--step-time", str(STEP_TIME_S), "--ckpt-dir", str(ckpt),
            "--ckpt-interval", str(CKPT_INTERVAL)]


def tasks() -> list[dict[str, object]]:
    buf = io.StringIO()
    with redirect_stdout(buf):
        cli(["tasks", "--json"])
    out: list[dict[str, object]] = json.loads(buf.getvalue())
    return out


def quiet_cli(argv: list[str]) -> int:
    with redirect_stdout(io.StringIO()):
        return cli(argv)


def unicron_restart(c: LocalCluster, name: str, work: Path) -> float:
    spec = work / f"{name}.json"
    spec.write_text(json.dumps({
        "name": name, "command": [sys.executable, *script_args(work / name)], "min_gpus": WORLD,
        "recovery": "restart", "env": {"UNICRON_PROGRESS_REGEX": r"^step (?P<iteration>\d+) "},
    }))
    assert quiet_cli(["submit", str(spec)]) == 0
    logs = Path(c.run_dir, "logs", name)
    run = Run(lambda: sorted(logs.glob("rank*.log")))
    try:
        t0 = kill_after_checkpoint(run, 60.0)
        t1 = float(wait_for(run.first_step_after_restart, 60.0, "the first step after the restart"))  # type: ignore[arg-type]
    finally:
        quiet_cli(["cancel", name])
    c.wait_for(lambda: not c.running_ranks(name), 30.0, f"{name}'s ranks to stop")
    return t1 - t0


def torchrun_restart(name: str, work: Path) -> float:
    out_path = work / f"{name}.out"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
            "--max-restarts=3", *script_args(work / name)]
    with open(out_path, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **TORCHRUN_ENV})
    run = Run(lambda: [out_path])
    try:
        t0 = kill_after_checkpoint(run, 60.0)
        t1 = float(wait_for(run.first_step_after_restart, 60.0, "the first step after the restart"))  # type: ignore[arg-type]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return t1 - t0


def log_hang(c: LocalCluster, name: str, work: Path) -> float:
    """A Megatron-style job SIGSTOPped right after a line: detection latency in D_iter."""
    spec = work / f"{name}.json"
    spec.write_text(json.dumps({
        "name": name, "min_gpus": 1, "recovery": "restart",
        "command": [sys.executable, str(MEGATRON_LOG), "--lines", "10000", "--log-interval", "1",
                    "--iter-ms", str(D_ITER_S * 1000)],
    }))
    assert quiet_cli(["submit", str(spec)]) == 0
    log = Path(c.run_dir, "logs", name, "rank0.log")

    def count() -> int:
        return len(log.read_text(errors="replace").splitlines()) if log.exists() else 0

    # The agent arms hang detection after its warm-up iterations plus 5 samples: leave a margin.
    wait_for(lambda: count() >= 14, 60.0, "the job's progress lines")
    pid = int(c.wait_for(lambda: c.running_ranks(name).get(0, {}).get("pid"), 10.0, "the rank's pid"))
    n = count()
    wait_for(lambda: count() > n, 5.0, "a fresh line", poll_s=0.002)
    t0 = time.time()
    os.kill(pid, signal.SIGSTOP)
    try:
        inc = c.wait_incident(lambda i: i.kind is ErrorKind.TASK_HANG and i.task == name, timeout_s=30.0, after=t0)
    finally:
        with contextlib.suppress(ProcessLookupError):  # the agent may have killed and reaped it already
            os.kill(pid, signal.SIGCONT)
        quiet_cli(["cancel", name])
    c.wait_for(lambda: not c.running_ranks(name), 30.0, f"{name}'s ranks to stop")
    return (inc.detected_ts - t0) / D_ITER_S


def use(c: LocalCluster) -> LocalCluster:
    """Point the CLI calls that follow at cluster ``c``."""
    os.environ["UNICRON_ETCD"] = c.etcd.endpoint
    os.environ["UNICRON_PREFIX"] = c.keys.prefix
    return c


def summary(xs: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(xs), 3), "min": round(min(xs), 3), "max": round(max(xs), 3)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 repetitions each, 1 hang (under a minute)")
    p.add_argument("--reps", type=int, default=0, help="repetitions each (default 7; --quick 2)")
    p.add_argument("--keep", type=Path, help="keep the jobs' outputs and checkpoints in this directory")
    p.add_argument("--only", choices=("restart", "cold", "torchrun", "hang"), action="append",
                   help="run only these parts (repeatable; default all; --quick leaves out cold)")
    args = p.parse_args()
    parts = set(args.only or ("restart", "torchrun", "hang", *(() if args.quick else ("cold",))))
    reps = args.reps or (2 if args.quick else 7)
    ours: list[float] = []
    theirs: list[float] = []
    hang: list[float] = []
    cold: list[float] = []
    with tempfile.TemporaryDirectory(prefix="unicron-bench-jobs-") as tmp, contextlib.ExitStack() as stack:
        c = stack.enter_context(LocalCluster(agents=1, gpus_per_agent=WORLD))
        # The same daemons without the warm spawner (UNICRON_PREFORK names no module): every rank is a
        # new interpreter that imports torch, as under torchrun. Shows what the spawner is worth.
        c_cold = (stack.enter_context(LocalCluster(agents=1, gpus_per_agent=WORLD, extra_env={"UNICRON_PREFORK": ","}))
                  if "cold" in parts else None)
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for i in range(reps):
            if "restart" in parts:
                ours.append(unicron_restart(use(c), f"job{i}", work))
                print(f"rep {i}: unicron {ours[-1]:.3f} s", file=sys.stderr, flush=True)
            if c_cold is not None:
                cold.append(unicron_restart(use(c_cold), f"cold{i}", work))
                print(f"rep {i}: unicron without the warm spawner {cold[-1]:.3f} s", file=sys.stderr, flush=True)
            if "torchrun" in parts:
                theirs.append(torchrun_restart(f"torchrun{i}", work))
                print(f"rep {i}: torchrun {theirs[-1]:.3f} s", file=sys.stderr, flush=True)
        for i in range(1 if args.quick else max(5, reps)) if "hang" in parts else ():
            hang.append(log_hang(use(c), f"mega{i}", work))
            print(f"hang {i}: {hang[-1]:.2f} D_iter", file=sys.stderr, flush=True)
    if not (ours and theirs and hang):  # a partial run (--only): the raw figures
        print(json.dumps({"bench": "jobs", "partial": sorted(parts), "restart_job_s": ours,
                          "torchrun_restart_s": theirs, "log_hang_diter": hang, "restart_job_cold_s": cold}))
        return 0
    ratios = [t / o for o, t in zip(ours, theirs, strict=True)]
    result = {
        "bench": "jobs", "quick": args.quick, "reps": reps, "world": WORLD, "step_time_s": STEP_TIME_S,
        "ckpt_interval": CKPT_INTERVAL, "fault_offset_s": FAULT_OFFSET_S,
        "restart_job_s": round(statistics.median(ours), 3), "restart_job_range_s": summary(ours),
        "torchrun_restart_s": round(statistics.median(theirs), 3), "torchrun_restart_range_s": summary(theirs),
        "vs_torchrun": round(statistics.median(theirs) / statistics.median(ours), 3),
        "vs_torchrun_per_rep_range": summary(ratios),
        "log_hang_diter": round(statistics.median(hang), 3), "log_hang_diter_range": summary(hang),
        "d_iter_s": D_ITER_S,
        **({"restart_job_cold_s": round(statistics.median(cold), 3), "restart_job_cold_range_s": summary(cold),
            "vs_torchrun_cold": round(statistics.median(theirs) / statistics.median(cold), 3)} if cold else {}),
        "targets": {"vs_torchrun": ">= 1.0", "log_hang_diter": "<= 3.5"},
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
