"""Hierarchical in-memory checkpoints (paper §3.1, §6.3; GEMINI-style).

Training side: :class:`CheckpointManager` (``save``, ``fence``, ``wait``, ``restore``, ``available``) with
:func:`capture_rng_state`/:func:`restore_rng_state`. Agent side: :class:`ReplicaServer` (holds, serves and
drops peers' snapshots) and :func:`replica_targets` (where a node's replicas go). Remote side:
:class:`Storage`, implemented by :class:`FilesystemStorage`. See docs/ckpt.md.
"""

# Nothing is re-exported: importing a submodule must not pull torch into the agent (which hosts the
# replica server) through this package's __init__.
