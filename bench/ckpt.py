"""Benchmark of hierarchical in-memory checkpoints (paper §3.1, §6.3) on a ~1 GB CPU training state.

    .venv/bin/python bench/ckpt.py [--quick]

The state is the full training state of the project's demo model (fp32 weights plus two AdamW moments,
LR scheduler, every RNG, data position): about 1.1 GB. Everything is measured in the same run:

* the snapshot's blocking time (what ``save()`` costs the training thread) and its copy throughput,
  against a plain ``tensor.copy_`` of as many bytes into an already-touched buffer (``memcpy_gbps``) and
  against ``torch.save`` of the same state to local disk (into the page cache; with fsync as well);
* the background stages: checksum + publish, replication to a peer over loopback TCP, persistence;
* restore time from each tier: local shared memory (into fresh tensors, and into the live model's
  tensors), a peer's memory (a new node with empty memory), remote storage (a new node, no peer; the
  files were evicted from the page cache after writing, so they are read from disk);
* the demo model's iteration without snapshots and with a snapshot after every iteration, blocking
  (plain copy inside save()) and overlapped (copy in the background, fence() before the step).

Demo model: ``unicron.runtime``'s Megatron-core GPT on CPU scaled up: 12 layers, hidden 768, 12 heads,
vocabulary 4096, context 256, fp32, AdamW (``ReplicaState``); an iteration is one micro-batch of
4 x 256 tokens forward/backward plus the optimizer step (--quick: 2 x 256, a shorter iteration, so the
stricter ratio; --quick also skips the iterations-with-snapshots comparison).

``--device cuda``: the same state on the GPU (micro-batch 32 x 256). save() then issues asynchronous
copies on a side stream into the page-locked slot and fence() makes the training stream wait for them;
``copy_gbps`` is timed from save() to the copies' end, ``memcpy_gbps`` is a plain device-to-host copy of
as many bytes into page-locked memory, and ``gpu_snapshot_every_step_overhead`` (no target) is how much
longer an iteration with a snapshot after every step takes.

Targets: copy_gbps >= 0.5 x memcpy_gbps (best of the interleaved repeats of each);
snapshot_blocking_s (blocking mode, median) <= 5 % of iteration_s (the median of 3 plain steps in
--quick, of the comparison's plain steps otherwise; before 2026-11-28 --quick took one step).
The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckpt.api import Tier
from ckpt.codec import encode
from ckpt.manager import CheckpointConfig, CheckpointManager
from ckpt.replica import ReplicaClient, ReplicaServer
from ckpt.rng import capture_rng_state
from ckpt.storage import FilesystemStorage

GB = 1e9


class Demo:
    """The project's demo model (``unicron.runtime``: Megatron-core GPT on CPU, its AdamW replica state)
    scaled to a ~1 GB training state; an iteration is one micro-batch forward/backward plus the step."""

    def __init__(self, batch: int, seq: int, device: torch.device) -> None:
        from unicron.runtime.comm import solo_group
        from unicron.runtime.model import ModelConfig, build_gpt, lm_loss
        from unicron.runtime.state import OptimConfig, ReplicaState

        self.group = solo_group()
        self.cfg = ModelConfig(layers=12, hidden=768, heads=12, seq=256, vocab=4096)
        self.device = device
        self.model = build_gpt(self.cfg, self.group).to(device)
        self.replica = ReplicaState(self.model, OptimConfig())  # AdamW moments created eagerly
        self.sched = torch.optim.lr_scheduler.CosineAnnealingLR(self.replica.optimizer, T_max=1000)
        self.loss = lm_loss
        self.batch, self.seq = batch, seq
        self.sample = 0

    @property
    def iteration(self) -> int:
        return self.replica.iteration

    def forward_backward(self) -> None:
        tokens = torch.randint(0, self.cfg.vocab, (self.batch, self.seq), device=self.device)
        loss = self.loss(self.model, tokens, torch.roll(tokens, -1, 1), self.group)
        loss.backward()  # type: ignore[no-untyped-call]

    def update(self) -> None:
        self.replica.optimizer.step()
        self.replica.optimizer.zero_grad(set_to_none=True)
        self.sched.step()
        self.replica.iteration += 1
        self.sample += self.batch

    def sync(self) -> None:
        """Wait for the GPU's queued work (a no-op on the CPU): timings end when the work did."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step(self) -> float:
        t0 = time.perf_counter()
        self.forward_backward()
        self.update()
        self.sync()
        return time.perf_counter() - t0

    def state(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.replica.optimizer.state_dict(),
            "scheduler": self.sched.state_dict(),
            "rng": capture_rng_state(),
            "data": {"sample": self.sample},
            "iteration": self.replica.iteration,
        }


def say(msg: str) -> None:
    print(msg, flush=True)


def timed_copy(dst: torch.Tensor, src: torch.Tensor) -> float:
    t = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - t


def torch_save(state: dict[str, Any], path: Path) -> tuple[float, float]:
    """Seconds of torch.save (returns once in the page cache) and of the fsync after it."""
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        t1 = time.perf_counter()
        os.fsync(f.fileno())
        t2 = time.perf_counter()
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    path.unlink()
    return t1 - t0, t2 - t1


def config(shm: Path, node: str, **kw: Any) -> CheckpointConfig:
    return CheckpointConfig(job="bench", rank=0, local_dir=str(shm / node / "rank-0"), **kw)


def copy_figures(
    fig: dict[str, Any], nbytes: int, blocking: list[float], copy: list[float], plain: list[float],
    publish: list[float],
) -> None:
    """The snapshot figures from the repeats' seconds: save() blocking, snapshot copy and plain copy of
    ``nbytes`` (best and median), checksum + publish."""
    fig["snapshot_blocking_s"] = round(statistics.median(blocking), 4)
    fig["snapshot_blocking_min_s"] = round(min(blocking), 4)
    fig["copy_gbps"] = round(nbytes / min(copy) / GB, 2)
    fig["memcpy_gbps"] = round(nbytes / min(plain) / GB, 2)
    fig["copy_median_gbps"] = round(nbytes / statistics.median(copy) / GB, 2)
    fig["memcpy_median_gbps"] = round(nbytes / statistics.median(plain) / GB, 2)
    fig["publish_s"] = round(statistics.median(publish), 3)
    fig["checksum_gbps"] = round(nbytes / statistics.median(publish) / GB, 2)


def gpu_snapshots(demo: Demo, shm: Path, reps: int, fig: dict[str, Any]) -> None:
    """GPU state: save() issues asynchronous copies into the page-locked slot, fence() makes the stream
    wait for them. Timed to the copies' end (save, fence, synchronize), against a plain device-to-host
    ``copy_`` of as many bytes into page-locked memory, interleaved, best and median of each."""
    with CheckpointManager(config(shm, "node-a")) as m:
        first = m.save(demo.state(), demo.iteration)
        m.fence()
        first.result()
        fig["snapshot_first_blocking_s"] = round(first.blocking_s, 3)
        say(f"first snapshot (allocates and page-locks its slot): blocking {first.blocking_s:.3f} s")
        demo.replica.iteration += 1
        m.save(demo.state(), demo.iteration)  # the second slot
        m.fence()
        m.wait()
        src = torch.ones(first.nbytes, dtype=torch.uint8, device=demo.device)
        dst = torch.zeros(first.nbytes, dtype=torch.uint8).pin_memory()
        blocking, done, plain, publish, parts = [], [], [], [], []
        for _ in range(reps):
            demo.sync()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            demo.sync()
            plain.append(time.perf_counter() - t0)
            demo.replica.iteration += 1
            t0 = time.perf_counter()
            t = m.save(demo.state(), demo.iteration)
            m.fence()
            demo.sync()
            done.append(time.perf_counter() - t0)
            blocking.append(t.blocking_s)
            parts.append((t.encode_s, t.wait_s, t.copy_s, t.blocking_s - t.encode_s - t.wait_s - t.copy_s))
            publish.append(dict(t.result().stage_s)["publish"])
        del src, dst
    copy_figures(fig, first.nbytes, blocking, done, plain, publish)
    names = ("save_encode_s", "save_slot_wait_s", "save_issue_s", "save_rest_s")
    for name, seconds in zip(names, zip(*parts, strict=True), strict=True):
        fig[name] = round(statistics.median(seconds), 5)  # where save()'s blocking time goes (medians)
    say(f"snapshot x{reps} of GPU state: save() blocked median {fig['snapshot_blocking_s']} s, "
        f"min {fig['snapshot_blocking_min_s']} s")
    say(f"  to the copies' end {fig['copy_gbps']} GB/s best, {fig['copy_median_gbps']} median; plain "
        f"device-to-host copy_ into page-locked memory {fig['memcpy_gbps']} GB/s best, "
        f"{fig['memcpy_median_gbps']} median")
    say(f"  of save(): encode {fig['save_encode_s']} s, waiting for a slot {fig['save_slot_wait_s']} s, "
        f"issuing the copies {fig['save_issue_s']} s, the rest (mapping the slot, bookkeeping) "
        f"{fig['save_rest_s']} s (medians)")
    say(f"  background checksum + publish: {fig['publish_s']} s ({fig['checksum_gbps']} GB/s)")


def snapshots(demo: Demo, shm: Path, reps: int, fig: dict[str, Any]) -> None:
    """Blocking snapshots (plain copy) interleaved with the plain-copy baseline, best and median of each."""
    if demo.device.type == "cuda":
        gpu_snapshots(demo, shm, reps, fig)
        return
    with CheckpointManager(config(shm, "node-a")) as m:
        first = m.save(demo.state(), demo.iteration)
        first.result()
        fig["snapshot_first_blocking_s"] = round(first.blocking_s, 3)
        say(f"first snapshot (allocates its slot): blocking {first.blocking_s:.3f} s")
        demo.replica.iteration += 1
        m.save(demo.state(), demo.iteration).result()  # allocates the second slot
        src = torch.ones(first.nbytes, dtype=torch.uint8)
        dst = torch.zeros(first.nbytes, dtype=torch.uint8)  # touched: the baseline pays no page faults either
        tickets, publish, plain = [], [], []
        for _ in range(reps):
            plain.append(timed_copy(dst, src))
            demo.replica.iteration += 1  # same tensors, next iteration number: isolates the snapshot
            t = m.save(demo.state(), demo.iteration)
            publish.append(dict(t.result().stage_s)["publish"])
            tickets.append(t)
        del src, dst
    copy_figures(fig, tickets[0].nbytes, [t.blocking_s for t in tickets], [t.copy_s for t in tickets], plain,
                 publish)
    say(
        f"snapshot x{reps} (plain copy into shared memory): blocking median {fig['snapshot_blocking_s']} s, "
        f"min {fig['snapshot_blocking_min_s']} s"
    )
    say(
        f"  copy {fig['copy_gbps']} GB/s best, {fig['copy_median_gbps']} median; plain tensor.copy_ of the "
        f"same bytes {fig['memcpy_gbps']} GB/s best, {fig['memcpy_median_gbps']} median"
    )
    say(f"  background checksum + publish: {fig['publish_s']} s ({fig['checksum_gbps']} GB/s)")


def iteration_time(demo: Demo, iters: int, fig: dict[str, Any]) -> None:
    """``iteration_s``: the median of ``iters`` plain steps (the denominator of blocking_vs_iteration:
    one step's noise must not decide the target)."""
    fig["iteration_s"] = round(statistics.median(demo.step() for _ in range(iters)), 3)
    say(f"demo iteration ({demo.batch}x{demo.seq} tokens): {fig['iteration_s']} s (median of {iters})")


def training_stall(demo: Demo, shm: Path, iters: int, fig: dict[str, Any]) -> None:
    """Iterations without snapshots, then with a snapshot after every step: blocking, then overlapped."""
    iteration_time(demo, iters, fig)
    # GPU state is always copied asynchronously (overlap concerns CPU tensors only): one mode
    modes = (("gpu", False),) if demo.device.type == "cuda" else (("blocking", False), ("overlap", True))
    for mode, overlap in modes:
        with CheckpointManager(config(shm, "node-a", overlap=overlap)) as m:
            demo.replica.iteration += 1
            m.save(demo.state(), demo.iteration)  # not timed: maps the (already allocated) slots
            m.wait()
            times, blocking = [], []
            for _ in range(iters):
                t0 = time.perf_counter()
                demo.forward_backward()
                m.fence()  # overlap: the previous snapshot's copy must be done before the step
                demo.update()
                blocking.append(m.save(demo.state(), demo.iteration).blocking_s)
                demo.sync()
                times.append(time.perf_counter() - t0)
            m.fence()
            m.wait()
        fig[f"iteration_with_{mode}_snapshot_s"] = round(statistics.median(times), 3)
        fig[f"{mode}_save_blocking_s"] = round(statistics.median(blocking), 4)
        say(
            f"iteration + snapshot every iteration ({mode}): {fig[f'iteration_with_{mode}_snapshot_s']} s "
            f"(save() blocked {fig[f'{mode}_save_blocking_s']} s)"
        )


def tiers(demo: Demo, shm: Path, disk: Path, state_bytes: int, fig: dict[str, Any]) -> None:
    """Replicate and persist one snapshot, then restore it from each tier in turn."""
    server = ReplicaServer("127.0.0.1:0", int(state_bytes * 2.5)).start()
    try:
        peer = ReplicaClient(server.address)
        storage = FilesystemStorage(disk / "remote")
        with CheckpointManager(config(shm, "node-a", persist_every=1), [peer], storage) as m:
            demo.replica.iteration += 1
            out = m.save(demo.state(), demo.iteration).result()
            assert out.published and out.replicas and out.persisted, out
            stages = dict(out.stage_s)
            fig["replicate_s"] = round(stages["replicate"], 3)
            fig["persist_s"] = round(stages["persist"], 3)
            say(
                f"replicate to a peer over loopback TCP: {stages['replicate']:.2f} s; persist to "
                f"{storage.describe()} (shards + fsync + manifest): {stages['persist']:.2f} s"
            )
            r = m.restore()
            assert r.tier == Tier.LOCAL and r.iteration == demo.iteration
            fig["restore_local_s"] = round(r.seconds, 3)
            del r
            r = m.restore(into=demo.state())
            fig["restore_local_into_s"] = round(r.seconds, 3)
            del r
        say(
            f"restore from local memory: {fig['restore_local_s']} s into new tensors, "
            f"{fig['restore_local_into_s']} s into the live model/optimizer"
        )
        with CheckpointManager(config(shm, "node-c"), [peer]) as m:  # a replacement node: empty memory
            r = m.restore()
            assert r.tier == Tier.PEER and r.iteration == demo.iteration
            fig["restore_peer_s"] = round(r.seconds, 3)
            del r
        say(f"restore from peer memory (new node): {fig['restore_peer_s']} s")
        with CheckpointManager(config(shm, "node-d"), storage=storage) as m:  # new node, no peer left
            r = m.restore()
            assert r.tier == Tier.REMOTE and r.iteration == demo.iteration
            fig["restore_remote_s"] = round(r.seconds, 3)
            del r
        say(f"restore from remote storage (new node, no peer, cold page cache): {fig['restore_remote_s']} s")
    finally:
        server.stop()


def run(args: argparse.Namespace, shm: Path, disk: Path) -> dict[str, Any]:
    fig: dict[str, Any] = {}
    batch, seq = (2, 256) if args.quick else (4, 256)
    device = torch.device(args.device)
    if device.type == "cuda":
        batch *= 8  # a GPU iteration of 4 x 256 tokens takes milliseconds; keep it a training step's size
    demo = Demo(batch, seq, device)
    state_bytes = encode(demo.state()).data_len
    fig["state_gb"] = round(state_bytes / GB, 3)
    fig["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    fig["demo_model"] = (f"unicron.runtime GPT 12x768 vocab 4096, micro-batch {batch}x{seq}, AdamW fp32, "
                         f"{fig['device']}")
    say(f"state: {fig['state_gb']} GB ({sum(p.numel() for p in demo.model.parameters()) / 1e6:.1f} M params)")
    demo.step()  # warm-up: the first iteration pays for allocating gradients and activations
    snapshots(demo, shm, 2 if args.quick else 6, fig)
    if args.quick:
        iteration_time(demo, 3, fig)
    else:
        training_stall(demo, shm, 20 if device.type == "cuda" else 3, fig)
    save_s, fsync_s = torch_save(demo.state(), disk / "torch_save.pt")
    fig["torch_save_gbps"] = round(state_bytes / save_s / GB, 2)
    fig["torch_save_fsync_gbps"] = round(state_bytes / (save_s + fsync_s) / GB, 2)
    say(
        f"torch.save to {disk}: {save_s:.2f} s ({fig['torch_save_gbps']} GB/s), +fsync {fsync_s:.2f} s "
        f"({fig['torch_save_fsync_gbps']} GB/s)"
    )
    tiers(demo, shm, disk, state_bytes, fig)
    return fig


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="a smaller micro-batch and fewer repeats (< 1 min)"
    )
    parser.add_argument("--shm", default="/dev/shm", help="where the shared-memory slots go")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="where the training state lives (cuda: the GPU path, asynchronous copies)")
    parser.add_argument(
        "--disk", default=None, help="local-disk directory for torch.save and 'remote' storage"
    )
    args = parser.parse_args()
    begin = time.perf_counter()
    shm = Path(args.shm) / f"unicron-bench-ckpt-{os.getpid()}"
    disk = Path(args.disk or Path(__file__).resolve().parents[1] / "out") / f"bench-ckpt-{os.getpid()}"
    disk.mkdir(parents=True, exist_ok=True)
    try:
        fig = run(args, shm, disk)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    fig["copy_vs_memcpy"] = round(fig["copy_gbps"] / fig["memcpy_gbps"], 3)
    if "iteration_with_gpu_snapshot_s" in fig:  # a measurement, no target: what a snapshot per step costs
        fig["gpu_snapshot_every_step_overhead"] = round(fig["iteration_with_gpu_snapshot_s"] / fig["iteration_s"] - 1, 3)
    if "overlap_save_blocking_s" in fig:
        fig["overlap_blocking_vs_iteration"] = round(fig["overlap_save_blocking_s"] / fig["iteration_s"], 4)
    fig["blocking_vs_iteration"] = round(fig["snapshot_blocking_s"] / fig["iteration_s"], 4)
    fig["targets_met"] = bool(fig["copy_vs_memcpy"] >= 0.5 and fig["blocking_vs_iteration"] <= 0.05)
    say(
        f"targets: copy/memcpy {fig['copy_vs_memcpy']} (>= 0.5), blocking/iteration "
        f"{fig['blocking_vs_iteration']} (<= 0.05): {'met' if fig['targets_met'] else 'NOT met'}"
    )
    fig["quick"] = bool(args.quick)
    fig["wall_s"] = round(time.perf_counter() - begin, 1)
    print(json.dumps(fig))
    return 0


if __name__ == "__main__":
    sys.exit(main())
