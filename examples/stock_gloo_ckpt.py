"""A stock torchrun-style training script that checkpoints, for ``recovery: "restart"``.

Nothing in it knows about Unicron. Every ``--ckpt-interval`` steps (default: every step) rank 0 saves
the model, the optimizer and the step to ``--ckpt-dir`` (written to a temporary file, then renamed: a rank
killed mid-save leaves the previous checkpoint whole); at start every rank loads it if it exists and goes on from the next step, as a
Megatron-LM job does with ``--save``/``--load``. So when Unicron (or torchrun) stops every rank after one
failed and relaunches them all, the job resumes where it was rather than at step 0.

Run it with ``torchrun --nproc-per-node 2 examples/stock_gloo_ckpt.py --ckpt-dir /tmp/ckpt`` or under
Unicron (``docs/jobs.md``, "Whole-job restarts"). Each start prints one line::

    start rank 1 pid 4242 restart_count 1 resume_step 7

and each completed step ``step N rank R/W loss L time T`` (``T``: ``time.time()`` when the step and its
checkpoint were done; parse the line with ``UNICRON_PROGRESS_REGEX``).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def load(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    state: dict[str, Any] = torch.load(path, weights_only=True)
    return state


def save(path: Path, state: dict[str, Any]) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save(state, tmp)
    os.replace(tmp, path)  # atomic: a reader sees the old checkpoint or the new one, never half of one


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--step-time", type=float, default=0.0, help="seconds of (simulated) work per step")
    p.add_argument("--ckpt-dir", type=Path, required=True)
    p.add_argument("--ckpt-interval", type=int, default=1, help="save a checkpoint every this many steps")
    args = p.parse_args()
    dist.init_process_group("gloo")  # init_method="env://"
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ckpt = args.ckpt_dir / "ckpt.pt"
    state = load(ckpt)
    first = 0
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        first = int(state["step"]) + 1
    print(f"start rank {rank} pid {os.getpid()} restart_count {os.environ.get('TORCHELASTIC_RESTART_COUNT')} "
          f"resume_step {first}", flush=True)
    for step in range(first, args.steps):
        data = torch.Generator().manual_seed(1000 * step + rank)  # a step's shard, the same after a resume
        x = torch.randn(32, 8, generator=data)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        for param in model.parameters():  # data parallelism by hand: average the gradients
            assert param.grad is not None
            dist.all_reduce(param.grad)
            param.grad /= world
        opt.step()
        time.sleep(args.step_time)
        if rank == 0 and (step + 1) % args.ckpt_interval == 0:
            args.ckpt_dir.mkdir(parents=True, exist_ok=True)
            save(ckpt, {"step": step, "model": model.state_dict(), "opt": opt.state_dict()})
        dist.barrier()  # no rank runs ahead of the checkpoint it would resume from
        print(f"step {step} rank {rank}/{world} loss {loss.item():.6f} time {time.time():.3f}", flush=True)
    print(f"done rank {rank}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
