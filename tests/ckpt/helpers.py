"""Small training states and a deep comparison for the checkpoint tests."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from ckpt.rng import capture_rng_state


def train_state(
    seed: int = 0, width: int = 32
) -> tuple[dict[str, Any], torch.nn.Sequential, torch.optim.Optimizer]:
    """A real (tiny) training state after two optimizer steps: model, AdamW, scheduler, RNGs, data."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        model(torch.randn(8, width)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    random.seed(seed)
    np.random.seed(seed)
    state = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "rng": capture_rng_state(),
        "data": {"epoch": 1, "sample_index": 4096 + seed},
        "iteration": 2,
    }
    return state, model, opt


def filled_state(iteration: int, nbytes: int = 1 << 16) -> dict[str, Any]:
    """A state whose every byte is a function of ``iteration`` (to check which snapshot came back)."""
    n = nbytes // 4
    return {
        "w": torch.full((n,), float(iteration)),
        "b": torch.arange(97, dtype=torch.int64) + iteration,
        "iteration": iteration,
    }


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Recursive equality: torch.equal (and same dtype) for tensors, == for the rest."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), path
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}/{i}")
    else:
        assert a == b, path
