"""Benchmark worker: the scheduler's cost against a plain training loop, in the same processes.

Each rank builds the runtime exactly as ``unicron train`` does, then alternates rounds of iterations
of three kinds on the same model, data and gloo group:

* ``plain``: what a training loop does without Unicron: forward/backward per micro-batch (autograd
  accumulating into ``.grad``), one in-place all-reduce of the gradients, divide by B, optimizer step;
  no store, no heartbeat, no reports, no bucket bookkeeping;
* ``scheduler``: :meth:`Trainer.step` in the default (sum) mode;
* ``deterministic``: :meth:`Trainer.step` in deterministic mode.

Alternating makes slow drifts of a shared machine hit all kinds alike. The order within a round is
shuffled (seeded by the round, so every rank runs the same kind at once): a fixed rotation keeps each
kind behind the same predecessor, so an iteration's after-effects on the next one (caches, the
allocator, the beater waking up) could bias the comparison.

Writes ``perf_rank<R>.json`` under ``--out-dir``: per kind, in round order, every iteration's
wall-clock seconds, process CPU seconds, the training thread's CPU seconds (what the loop itself
computes, without waiting or gloo's threads), and the seconds spent in the parts both loops share
(forward/backward, waiting for collectives, the optimizer step). What remains of an iteration after
those is the loop's own cost: the scheduler's bookkeeping against the plain loop's, measurable even
when the machine's noise swamps a 1 % difference of whole iterations.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from unicron.kernel.errors import ConfigError, TemporaryError
from unicron.runtime.comm import CommGroup, Work
from unicron.runtime.flags import add_arguments
from unicron.runtime.plan import initial_plan
from unicron.runtime.scheduler import Trainer
from unicron.runtime.train import build

MODES = ("plain", "scheduler", "deterministic")
SHARED = ("compute", "comm", "optimizer")


class Stopwatch:
    def __init__(self) -> None:
        self.t = dict.fromkeys(SHARED, 0.0)

    def timed(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.t[part] += time.perf_counter() - t0

        return run


class TimedWork:
    def __init__(self, work: Work, sw: Stopwatch) -> None:
        self.work, self.sw = work, sw

    def wait(self) -> Any:
        return self.sw.timed("comm", self.work.wait)()


class TimedGroup:
    """Wraps a process group so that waiting for its collectives is timed (benchmark only)."""

    def __init__(self, group: CommGroup, sw: Stopwatch) -> None:
        self.group, self.sw = group, sw

    def rank(self) -> int:
        return self.group.rank()

    def size(self) -> int:
        return self.group.size()

    def abort(self) -> None:
        self.group.abort()

    def allreduce(self, tensors: list[torch.Tensor], *opts: Any) -> TimedWork:
        return TimedWork(self.group.allreduce(tensors, *opts), self.sw)

    def broadcast(self, tensor: torch.Tensor, root: int) -> TimedWork:
        return TimedWork(self.group.broadcast(tensor, root), self.sw)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor]) -> TimedWork:
        return TimedWork(self.group.allgather(outputs, inputs), self.sw)


def plain_step(trainer: Trainer[Any], iteration: int, sw: Stopwatch | None = None) -> None:
    """One iteration of a conventional data-parallel loop on the trainer's model and groups (whose
    collectives and optimizer step the worker times when it wrapped them)."""
    sw = sw or Stopwatch()
    model, group = trainer.state.model, trainer.groups.dp
    layout = trainer.layout
    mine = initial_plan(layout, trainer.topo.replicas_in(trainer.groups.record.members))[trainer.replica]

    def compute(mb: int) -> None:  # (no reseeding: a plain loop has no micro-batch identities)
        trainer.job.loss(model, iteration, mb).backward()  # type: ignore[no-untyped-call]

    # the trainer's own iterations leave their last micro-batch's gradient in the buffer (each of
    # theirs zeroes it as it begins): so does this one, or its first step follows theirs wrongly
    trainer.flat.buf.zero_()
    for mb in mine:
        sw.timed("compute", compute)(mb)
    grads = trainer.flat.grads
    group.allreduce([grads]).wait()
    grads.mul_(1.0 / layout.micro_batches)
    trainer.state.optimizer.step()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m unicron.runtime.perf")
    add_arguments(parser)
    parser.add_argument("--rounds", type=int, default=4, help="rounds of the three kinds (first is warm-up)")
    parser.add_argument("--per-round", type=int, default=3, help="iterations of each kind per round")
    parser.add_argument("--no-heartbeat", action="store_true", help="diagnostic: keep the beater paused throughout")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="kinds to alternate (diagnostic: 'plain,plain-b' is an A/A test of the method)")
    args = parser.parse_args(argv)
    try:
        built = build(args)
    except (ConfigError, TemporaryError) as exc:
        print(f"perf: {exc}", file=sys.stderr)
        return 2
    trainer, heartbeat = built.trainer, built.heartbeat
    trainer.begin()
    sw = Stopwatch()
    dp = trainer.groups.dp
    timed_dp = cast(CommGroup, TimedGroup(dp, sw))
    trainer.groups.dp = timed_dp
    if trainer.groups.world is dp:
        trainer.groups.world = timed_dp
    trainer._forward_backward = sw.timed("compute", trainer._forward_backward)  # type: ignore[method-assign]
    opt = trainer.state.optimizer
    opt.step = sw.timed("optimizer", opt.step)  # type: ignore[method-assign]
    modes = tuple(args.modes.split(","))
    times: dict[str, list[float]] = {m: [] for m in modes}
    cpu: dict[str, list[float]] = {m: [] for m in modes}
    thread_cpu: dict[str, list[float]] = {m: [] for m in modes}
    shared: dict[str, list[float]] = {m: [] for m in modes}
    parts: dict[str, dict[str, list[float]]] = {m: {p: [] for p in SHARED} for m in modes}
    plain_it = 0
    for r in range(args.rounds):
        order = list(modes)
        random.Random(r).shuffle(order)
        for mode in order:
            plain = mode.startswith("plain")
            heartbeat.paused = plain or args.no_heartbeat
            if not plain:
                trainer.set_deterministic(mode == "deterministic")
            for _ in range(args.per_round):
                sw.t = dict.fromkeys(SHARED, 0.0)
                t0, c0, tc0 = time.perf_counter(), time.process_time(), time.thread_time()
                if plain:
                    plain_step(trainer, plain_it, sw)
                    plain_it += 1
                else:
                    trainer.step()
                if r > 0:
                    times[mode].append(time.perf_counter() - t0)
                    cpu[mode].append(time.process_time() - c0)
                    thread_cpu[mode].append(time.thread_time() - tc0)
                    shared[mode].append(sum(sw.t.values()))
                    for p in SHARED:
                        parts[mode][p].append(sw.t[p])
    heartbeat.paused = False
    trainer.store.set("finished", str(trainer.it))
    heartbeat.stop()
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, f"perf_rank{trainer.rank}.json"), "w") as fh:
            json.dump({"rank": trainer.rank, "times": times, "cpu": cpu, "thread_cpu": thread_cpu, "shared": shared,
                       "parts": parts}, fh)
    built.client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
