"""The environment of a rank the agent launches: what ``torchrun`` gives its workers, plus Unicron's.

Checked against torch 2.13's own elastic agent, so that an unmodified script written for
``torchrun`` runs here unchanged:

* ``torch/distributed/elastic/agent/server/local_elastic_agent.py`` (``_start_workers``) sets, per
  worker: RANK, GROUP_RANK, ROLE_RANK, ROLE_NAME, LOCAL_WORLD_SIZE, WORLD_SIZE, GROUP_WORLD_SIZE,
  ROLE_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT (``max_restarts -
  remaining_restarts``: restarts of the worker group so far), TORCHELASTIC_MAX_RESTARTS,
  TORCHELASTIC_RUN_ID (the rendezvous id, stable across restarts; ``dist.is_torchelastic_launched()``
  in ``distributed_c10d.py`` tests only that it exists), TORCHELASTIC_USE_AGENT_STORE (``str(bool)``)
  and TORCH_NCCL_ASYNC_ERROR_HANDLING (default "1"); ``multiprocessing/api.py`` (``_get_log_dests``)
  sets TORCHELASTIC_ERROR_FILE, a fresh file per attempt and worker (:mod:`agent.errorfile`);
  ``_set_local_rank_env`` sets LOCAL_RANK and, in
  its default ("traditional") mode, leaves CUDA_VISIBLE_DEVICES as the agent's own.
* ``torch/distributed/elastic/agent/server/api.py`` (``_assign_worker_ranks``): with one role, ROLE_RANK
  is the global rank and ROLE_WORLD_SIZE the world size; ``run.py`` documents ROLE_NAME's default,
  "default", and GROUP_RANK as the node's rank.
* ``torch/distributed/rendezvous.py`` (``_create_c10d_store``, used by ``env://`` and ``tcp://``):
  only when ``os.environ["TORCHELASTIC_USE_AGENT_STORE"] == str(True)`` ("True", exactly) does rank 0
  connect to MASTER_ADDR:MASTER_PORT as a client; otherwise rank 0 starts a TCPStore server there.
  MASTER_ADDR:MASTER_PORT is the task's store sidecar (``agent/sidecar.py``), which already listens
  on that port: without the variable, ``init_process_group("gloo")`` on rank 0 fails with EADDRINUSE
  (``tests/agent/test_torchrun_env.py`` shows both).

CUDA_VISIBLE_DEVICES is where we differ, on purpose: torchrun leaves it alone because it owns the
whole node, while a Unicron node may run several tasks. Each rank sees exactly its node's GPUs of
this task, listed in local-rank order, so ``torch.cuda.set_device(LOCAL_RANK)`` (what torchrun
scripts and Megatron do) selects the rank's own GPU (``RankSpec.gpu``), and no task can touch
another's GPUs. With the simulated GPU backend it is not set (the simulated GPUs are not the
machine's). The GPU numbers are NVML's (PCI bus order), so CUDA_DEVICE_ORDER=PCI_BUS_ID goes with them.

Unicron's ``unicron train`` ranks (``unicron.runtime.train``) read RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT and the UNICRON_* variables, and connect to the store as clients themselves: none of
the added variables changes them (they use no GPU index).
"""

from __future__ import annotations

from collections.abc import Mapping

from agent.errorfile import ENV_ERROR_FILE
from unicron.kernel import protocol
from unicron.kernel.types import RankSpec, StoreAddress, TaskAssignment

#: torchrun's default role name (``run.py``: ``--role``, default "default")
ROLE_NAME = "default"


def visible_devices(a: TaskAssignment) -> str:
    """The node's GPUs of task ``a`` in local-rank order: device i is local rank i's GPU."""
    return ",".join(str(s.gpu) for s in sorted(a.ranks, key=lambda s: s.local_rank))


def torchrun_env(a: TaskAssignment, spec: RankSpec, store: StoreAddress, *, set_cuda: bool,
                 error_file: str | None = None) -> dict[str, str]:
    """The torchrun variables of rank ``spec`` of task ``a`` whose store sidecar is ``store``;
    ``error_file``: this launch's error file (:func:`agent.errorfile.path_for`), None: not set."""
    env = {
        "RANK": str(spec.rank),
        "LOCAL_RANK": str(spec.local_rank),
        "WORLD_SIZE": str(a.world_size),
        "LOCAL_WORLD_SIZE": str(len(a.ranks)),
        "GROUP_RANK": str(a.group_rank),
        "GROUP_WORLD_SIZE": str(a.group_world_size),
        "ROLE_NAME": ROLE_NAME,
        "ROLE_RANK": str(spec.rank),
        "ROLE_WORLD_SIZE": str(a.world_size),
        "MASTER_ADDR": store.host,
        "MASTER_PORT": str(store.port),
        # A sev2 restart relaunches with a new restart epoch: the number of restarts so far.
        "TORCHELASTIC_RESTART_COUNT": str(a.restart_epoch),
        "TORCHELASTIC_MAX_RESTARTS": str(a.max_restarts),
        "TORCHELASTIC_RUN_ID": a.task,
        # Ranks are clients of the sidecar's store, never its host (see the module docstring).
        "TORCHELASTIC_USE_AGENT_STORE": str(True),
    }
    if error_file is not None:
        # where a @record-decorated main writes its exception (unset, it writes nothing)
        env[ENV_ERROR_FILE] = error_file
    if set_cuda:
        env["CUDA_VISIBLE_DEVICES"] = visible_devices(a)
        # RankSpec.gpu is an NVML index (PCI bus order); CUDA's default order is "fastest first".
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    return env


def rank_env(base: Mapping[str, str], a: TaskAssignment, spec: RankSpec, store: StoreAddress, *, node: str,
             socket_path: str, set_cuda: bool, error_file: str | None = None) -> dict[str, str]:
    """The whole environment of a rank: ``base`` (the agent's), the task's own variables, then the
    launch variables, which the task's cannot override (a wrong RANK or MASTER_PORT breaks the job)."""
    env = dict(base)
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # torchrun's default: NCCL errors abort the rank
    # a rank's stdout is a pipe to the agent, which Python block-buffers: progress lines printed without
    # a flush arrived in bursts, their intervals measured ~0 s, and every burst's gap read as a hang
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.pop("CUDA_VISIBLE_DEVICES", None)  # the agent's own never leaks into a rank
    env.update(a.env)
    env.update(torchrun_env(a, spec, store, set_cuda=set_cuda, error_file=error_file))
    env.update({
        protocol.ENV_SOCKET: socket_path, "UNICRON_TASK": a.task, "UNICRON_GENERATION": str(a.generation),
        "UNICRON_NODE": node, protocol.ENV_STORE_EPOCH: str(store.store_epoch),
    })
    return env
