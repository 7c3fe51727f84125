"""Hierarchical in-memory checkpoints (paper §3.1, §6.3; GEMINI-style).

Training side: :class:`CheckpointManager` (``save``, ``fence``, ``wait``, ``restore``, ``available``) with
:func:`capture_rng_state`/:func:`restore_rng_state`. Agent side: :class:`ReplicaServer` (holds, serves and
drops peers' snapshots) and :func:`replica_targets` (where a node's replicas go). Remote side:
:class:`Storage`, implemented by :class:`FilesystemStorage`. See docs/ckpt.md.
"""

from ckpt.api import (
    CheckpointCorrupt,
    Checkpointer,
    CheckpointError,
    NoValidCheckpoint,
    ObjectMissing,
    ReplicaRejected,
    ReplicaStore,
    ReplicaUnavailable,
    Restored,
    SaveOutcome,
    Snapshot,
    SnapshotInfo,
    Storage,
    StorageUnavailable,
    Tier,
    TierAttempt,
)
from ckpt.local import LocalStore
from ckpt.manager import CheckpointConfig, CheckpointManager, SaveTicket
from ckpt.placement import replica_plan, replica_targets
from ckpt.replica import ReplicaClient, ReplicaMemory, ReplicaServer
from ckpt.rng import capture_rng_state, restore_rng_state
from ckpt.storage import FilesystemStorage, MemoryStorage

__all__ = [
    "CheckpointConfig",
    "CheckpointCorrupt",
    "CheckpointError",
    "CheckpointManager",
    "Checkpointer",
    "FilesystemStorage",
    "LocalStore",
    "MemoryStorage",
    "NoValidCheckpoint",
    "ObjectMissing",
    "ReplicaClient",
    "ReplicaMemory",
    "ReplicaRejected",
    "ReplicaServer",
    "ReplicaStore",
    "ReplicaUnavailable",
    "Restored",
    "SaveOutcome",
    "SaveTicket",
    "Snapshot",
    "SnapshotInfo",
    "Storage",
    "StorageUnavailable",
    "Tier",
    "TierAttempt",
    "capture_rng_state",
    "replica_plan",
    "replica_targets",
    "restore_rng_state",
]
