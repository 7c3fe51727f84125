"""A stock torchrun-style training script: nothing in it knows about Unicron.

Run it with ``torchrun --nproc-per-node 2 examples/stock_gloo.py`` or under Unicron (``unicron submit``
with ``"command": ["python", "examples/stock_gloo.py"]``): both give it the same environment
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE, ...).
"""

from __future__ import annotations

import argparse
import hashlib
import os

import torch
import torch.distributed as dist


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    dist.init_process_group("gloo")  # init_method="env://"
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(1000 + rank)  # each rank its own shard
    for step in range(args.steps):
        x = torch.randn(32, 8, generator=data)
        y = x.sum(dim=1, keepdim=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        for param in model.parameters():  # data parallelism by hand: average the gradients
            assert param.grad is not None
            dist.all_reduce(param.grad)
            param.grad /= world
        opt.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        print(f"step {step} rank {rank}/{world} local_rank {os.environ.get('LOCAL_RANK')} "
              f"loss {mean_loss.item() / world:.6f}", flush=True)
    # Replicas that averaged the same gradients hold the same weights: a digest every rank can compare.
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    print(f"done rank {rank} weights {digest[:16]}", flush=True)
    # A barrier before tearing down, as many stock scripts do; here it also dodges a race in torch
    # 2.13. A gloo worker thread drops its reference to a finished all_reduce after the caller went on,
    # and since the tensors are Python objects that takes the GIL. Once an optimizer has imported
    # torch._dynamo, destroy_process_group no longer joins those threads, so a rank that reached
    # interpreter exit first aborted ("terminate called without an active exception"): 3 of 480 rank
    # exits on 2 loaded cores without the barrier, 0 of 480 with it (the barrier's tensor is C++'s, and
    # waiting for the peers gives the worker its GIL). Rarer, not impossible: the fix is torch's.
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
