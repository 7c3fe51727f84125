"""Checkpoint hooks of the training runtime, through the ckpt subsystem's ``Checkpointer`` interface.

* ``memory``: :class:`ckpt.manager.CheckpointManager`, the hierarchical in-memory checkpoint (its own
  issue); used by :class:`unicron.runtime.state.CheckpointSource` when no replica holds the state.
* ``torch-save``: :class:`TorchSaveCheckpointer`, every snapshot persisted with ``torch.save`` (the
  conventional restart-from-checkpoint path; the benchmark's baseline).
"""

from __future__ import annotations

import glob
import os
import re
import time
from typing import Any

import torch

from ckpt.api import Checkpointer, NoValidCheckpoint, Restored, Tier, TierAttempt
from unicron.errors import ConfigError

KINDS = ("none", "torch-save", "memory")


class TorchSaveCheckpointer(Checkpointer):
    """``<directory>/rank<R>/it<N>.pt`` written atomically (temp file + rename); keeps the last ``keep``."""

    def __init__(self, directory: str, rank: int, keep: int = 2) -> None:
        self.dir = os.path.join(directory, f"rank{rank}")
        self.rank = rank
        self.keep = keep
        os.makedirs(self.dir, exist_ok=True)

    def _path(self, iteration: int) -> str:
        return os.path.join(self.dir, f"it{iteration}.pt")

    def held(self) -> list[int]:
        """Iterations of the snapshots on disk, ascending."""
        found = (re.match(r"it(\d+)\.pt$", os.path.basename(p)) for p in glob.glob(os.path.join(self.dir, "it*.pt")))
        return sorted(int(m.group(1)) for m in found if m)

    def save(self, state: Any, iteration: int) -> None:
        tmp = self._path(iteration) + ".tmp"
        torch.save(state, tmp)
        os.replace(tmp, self._path(iteration))
        for old in self.held()[: -self.keep]:
            os.remove(self._path(old))

    def restore(self, iteration: int | None = None, into: Any = None) -> Restored:
        t0 = time.perf_counter()
        held = self.held()
        want = iteration if iteration is not None else (held[-1] if held else None)
        if want is None or want not in held:
            attempt = TierAttempt(Tier.REMOTE, self.dir, want, "no such checkpoint file")
            raise NoValidCheckpoint("torch-save", self.rank, iteration, [attempt])
        state = torch.load(self._path(want), map_location="cpu", weights_only=True)
        return Restored(state, want, Tier.REMOTE, self._path(want), seconds=time.perf_counter() - t0)


def has_checkpoint(checkpointer: Checkpointer) -> bool:
    """Whether ``checkpointer`` holds any snapshot of this rank (cheap: nothing is loaded)."""
    if isinstance(checkpointer, TorchSaveCheckpointer):
        return bool(checkpointer.held())
    available = getattr(checkpointer, "available", None)
    if callable(available):  # CheckpointManager: (tier, source, iterations or None) per source
        return any(iterations for _, _, iterations in available())
    return True


def make_checkpointer(kind: str, directory: str, job: str, rank: int) -> Checkpointer | None:
    """The checkpointer named by ``--ckpt``; None for ``none``."""
    if kind == "none":
        return None
    if kind == "torch-save":
        if not directory:
            raise ConfigError("--ckpt torch-save needs --ckpt-dir DIR")
        return TorchSaveCheckpointer(directory, rank)
    if kind == "memory":
        from ckpt.manager import CheckpointConfig, CheckpointManager

        name = re.sub(r"[^A-Za-z0-9._-]", "-", job or "local")[:128] or "local"
        local = os.path.join(directory, f"rank-{rank}") if directory else ""
        return CheckpointManager(CheckpointConfig(job=name, rank=rank, local_dir=local))
    raise ConfigError(f"--ckpt {kind!r}: choose one of {KINDS}")
