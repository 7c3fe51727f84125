"""Capturing and restoring every random number generator a training step draws from.

Put ``capture_rng_state()`` in the saved state and call ``restore_rng_state()`` after a restore: the
streams then continue exactly where they were (dropout masks, data shuffling, sampling).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ckpt.api import CheckpointError


def capture_rng_state(generators: Mapping[str, torch.Generator] | None = None) -> dict[str, Any]:
    """Python's, NumPy's global, torch's CPU and (if initialised) every CUDA device's generator, plus
    the named explicit ``generators`` (e.g. a DataLoader's)."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    if generators:
        state["generators"] = {name: g.get_state() for name, g in generators.items()}
    return state


def restore_rng_state(
    state: Mapping[str, Any], generators: Mapping[str, torch.Generator] | None = None
) -> None:
    """Inverse of :func:`capture_rng_state`; ``generators`` must name the same generators."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        if not torch.cuda.is_available():
            raise CheckpointError("the state holds CUDA generator states but this process has no CUDA device")
        torch.cuda.set_rng_state_all(state["cuda"])
    saved = state.get("generators", {})
    for name, g in (generators or {}).items():
        if name not in saved:
            raise CheckpointError(
                f"restore_rng_state: generator {name!r} is not in the saved state (saved: {sorted(saved)})"
            )
        g.set_state(saved[name])
