"""Benchmark worker: the scheduler's cost against a plain training loop, in the same processes.

Each rank builds the runtime exactly as ``unicron train`` does, then alternates rounds of iterations
of three kinds on the same model, data and gloo group:

* ``plain``: what a training loop does without Unicron: forward/backward per micro-batch (autograd
  accumulating into ``.grad``), one in-place all-reduce of the gradients, divide by B, optimizer step;
  no store, no heartbeat, no reports, no bucket bookkeeping;
* ``scheduler``: :meth:`Trainer.step` in the default (sum) mode;
* ``deterministic``: :meth:`Trainer.step` in deterministic mode.

Alternating (and rotating the order every round) makes slow drifts of a shared machine hit all three
alike. Writes ``perf_rank<R>.json`` under ``--out-dir``: every iteration's wall-clock seconds and
process CPU seconds (all threads: gloo's, the heartbeat's), per kind, in round order.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

from unicron.errors import ConfigError, TemporaryError
from unicron.runtime.cli import add_arguments
from unicron.runtime.plan import initial_plan
from unicron.runtime.scheduler import Trainer
from unicron.runtime.train import build

MODES = ("plain", "scheduler", "deterministic")


def plain_step(trainer: Trainer, iteration: int) -> None:
    """One iteration of a conventional data-parallel loop on the trainer's model and groups."""
    model, group, tp = trainer.state.model, trainer.groups.dp, trainer.groups.tp
    layout = trainer.layout
    mine = initial_plan(layout, trainer.topo.replicas_in(trainer.groups.record.members))[trainer.replica]
    from unicron.runtime.model import lm_loss

    for mb in mine:  # (no per-micro-batch reseeding: a plain loop has no micro-batch identities)
        tokens, labels = trainer.data.batch(iteration, mb)
        lm_loss(model, tokens, labels, tp).backward()  # type: ignore[no-untyped-call]
    grads = trainer.flat.grads
    group.allreduce([grads]).wait()
    grads.mul_(1.0 / layout.micro_batches)
    trainer.state.optimizer.step()
    trainer.flat.buf.zero_()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m unicron.runtime.perf")
    add_arguments(parser)
    parser.add_argument("--rounds", type=int, default=4, help="rounds of the three kinds (first is warm-up)")
    parser.add_argument("--per-round", type=int, default=3, help="iterations of each kind per round")
    args = parser.parse_args(argv)
    try:
        built = build(args)
    except (ConfigError, TemporaryError) as exc:
        print(f"perf: {exc}", file=sys.stderr)
        return 2
    trainer, heartbeat = built.trainer, built.heartbeat
    trainer.begin()
    times: dict[str, list[float]] = {m: [] for m in MODES}
    cpu: dict[str, list[float]] = {m: [] for m in MODES}
    plain_it = 0
    for r in range(args.rounds):
        order = MODES[r % 3 :] + MODES[: r % 3]
        for mode in order:
            heartbeat.paused = mode == "plain"
            if mode != "plain":
                trainer.set_deterministic(mode == "deterministic")
            for _ in range(args.per_round):
                t0, c0 = time.perf_counter(), time.process_time()
                if mode == "plain":
                    plain_step(trainer, plain_it)
                    plain_it += 1
                else:
                    trainer.step()
                if r > 0:
                    times[mode].append(time.perf_counter() - t0)
                    cpu[mode].append(time.process_time() - c0)
    heartbeat.paused = False
    trainer.store.set("finished", str(trainer.it))
    heartbeat.stop()
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, f"perf_rank{trainer.rank}.json"), "w") as fh:
            json.dump({"rank": trainer.rank, "times": times, "cpu": cpu}, fh)
    built.client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
