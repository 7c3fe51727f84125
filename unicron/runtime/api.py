"""``pretrain``: any model, loss and data on Unicron's runtime, with in-place recovery.

Shaped like Megatron-LM's ``pretrain(train_valid_test_datasets_provider, model_provider, model_type,
forward_step_func, extra_args_provider=None, args_defaults={})``. The job supplies its model, forward
step and data (:mod:`unicron.runtime.job`); the runtime owns the rest: the micro-batch loop, backward,
gradient reduction over data-parallel replicas, redistribution of a dead rank's micro-batches,
regroups and rejoins, checkpoints, and reports to the agent. ``unicron train``
(:mod:`unicron.runtime.train`) is one user of it; ``examples/pretrain_mlp.py`` is another.

One process per rank, in the environment the agent (or torchrun-style launcher) sets: ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` (the task's store), optionally
``UNICRON_AGENT_SOCKET``, ``UNICRON_TASK``. Run it under ``unicron submit`` with
``"recovery": "inprocess"``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic

import torch

from unicron.kernel import log as ulog
from unicron.kernel import protocol
from unicron.kernel.client import AgentClient
from unicron.kernel.config import out_of_bounds
from unicron.kernel.errors import ConfigError, PermanentError, TemporaryError
from unicron.runtime import membership
from unicron.runtime import store as keys
from unicron.runtime.checkpoint import make_checkpointer
from unicron.runtime.comm import ensure_torch_distributed
from unicron.runtime.faults import FaultScript
from unicron.runtime.flags import EXIT_CONFIG, add_runtime_arguments, env_name
from unicron.runtime.heartbeat import Heartbeat
from unicron.runtime.job import BatchT, DataContext, ForwardStep, Job, MicroBatches, ModelProvider
from unicron.runtime.membership import CommSettings
from unicron.runtime.model import ModelType
from unicron.runtime.plan import Topology
from unicron.runtime.preempt import Preemption
from unicron.runtime.scheduler import ScheduleConfig, Trainer
from unicron.runtime.state import OptimConfig

DatasetsProvider = Callable[[DataContext], "MicroBatches[BatchT] | tuple[MicroBatches[BatchT], None, None]"]
ExtraArgsProvider = Callable[[argparse.ArgumentParser], "argparse.ArgumentParser | None"]


@dataclass(frozen=True)
class Providers(Generic[BatchT]):
    """The job's functions, as given to :func:`pretrain`."""

    datasets: DatasetsProvider[BatchT]
    model: ModelProvider
    forward_step: ForwardStep[BatchT]


@dataclass
class Rank(Generic[BatchT]):
    """A rank's runtime, built from the command line and environment but not yet running."""

    trainer: Trainer[BatchT]
    heartbeat: Heartbeat
    client: AgentClient


def pretrain(
    train_valid_test_datasets_provider: DatasetsProvider[BatchT],
    model_provider: ModelProvider,
    model_type: ModelType,
    forward_step_func: ForwardStep[BatchT],
    *,
    extra_args_provider: ExtraArgsProvider | None = None,
    args_defaults: Mapping[str, object] | None = None,
    argv: Sequence[str] | None = None,
    prog: str | None = None,
) -> int:
    """Train one rank of the job until its iterations are done or it is stopped; returns the exit
    status (0, or :data:`EXIT_CONFIG` after a one-line error naming a bad flag or variable).

    ``train_valid_test_datasets_provider(ctx: DataContext)`` returns the training micro-batches (an
    object with ``batch(iteration, mb)``), or Megatron's triple with ``None`` for validation and test
    (evaluation is not run). ``model_provider(ctx: ModelContext)`` returns a ``torch.nn.Module``;
    ``forward_step_func(batch, model)`` returns the micro-batch's mean loss. ``model_type`` is
    Megatron-core's ``ModelType.encoder_or_decoder`` (the only kind without pipeline parallelism).
    The command line (``argv``, default ``sys.argv[1:]``) takes the runtime's flags (``--help``) and
    those ``extra_args_provider(parser)`` adds; ``args_defaults`` replaces flag defaults, as in
    Megatron (a flag or its ``UNICRON_TRAIN_*`` variable still wins).
    """
    parser = make_parser(extra_args_provider, args_defaults, prog)
    args = parser.parse_args(argv)
    providers = Providers(train_valid_test_datasets_provider, model_provider, forward_step_func)
    return run(args, providers, model_type, prog=parser.prog)


def make_parser(
    extra_args_provider: ExtraArgsProvider | None = None,
    args_defaults: Mapping[str, object] | None = None,
    prog: str | None = None,
) -> argparse.ArgumentParser:
    """The runtime's flags, the job's own, and ``args_defaults`` (below a flag's environment variable)."""
    parser = argparse.ArgumentParser(prog=prog, description="One rank of a job on Unicron's runtime.")
    add_runtime_arguments(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser) or parser
    defaults = {k: v for k, v in (args_defaults or {}).items() if env_name(k.replace("_", "-")) not in os.environ}
    parser.set_defaults(**defaults)
    return parser


def _env_int(name: str, default: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None:
        if default is None:
            raise ConfigError(f"environment variable {name} is not set (the agent or launcher sets it)")
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from exc


def rank_device(choice: str, backend: str, local_rank: int) -> str:
    """``CommSettings.device`` for ``--device`` (see its help); a ConfigError names what cannot work."""
    if choice == "auto":
        choice = "cuda" if backend == "nccl" else "cpu"
    if choice == "cpu":
        if backend == "nccl":
            raise ConfigError("--backend nccl reduces CUDA tensors only: use --device cuda (or auto), "
                              "or --backend gloo on the CPU")
        return "cpu"
    if choice != "cuda":
        raise ConfigError(f"--device {choice!r}: choose auto, cpu or cuda")
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not 0 <= local_rank < visible:
        raise ConfigError(
            f"--device cuda: LOCAL_RANK={local_rank} but this rank sees {visible} GPU(s) "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); the rank uses the "
            "GPU numbered LOCAL_RANK, so run one rank per visible GPU, or --device cpu with --backend gloo")
    return f"cuda:{local_rank}"


def configs(args: argparse.Namespace) -> tuple[OptimConfig, ScheduleConfig, CommSettings]:
    """The runtime's settings from its flags (:func:`unicron.runtime.flags.add_runtime_arguments`)."""
    if args.micro_batch_size < 1 or args.global_batch_size % args.micro_batch_size:
        raise ConfigError(
            f"--global-batch-size {args.global_batch_size} must be a positive multiple of "
            f"--micro-batch-size {args.micro_batch_size}"
        )
    bounds: dict[str, dict[str, float]] = {
        "--iterations": {"least": 0}, "--manual-gc-interval": {"least": 0}, "--threads": {"least": 1},
        "--iter-sleep": {"least": 0}, "--bucket-elems": {"least": 1}, "--blocks": {"least": 0},
        "--ckpt-every": {"least": 0}, "--ckpt-persist-every": {"least": 0},
        "--collective-timeout": {"above": 0}, "--join-timeout": {"above": 0},
        # numpy's generators (the indexed dataset's order) take no negative seed, torch.manual_seed
        # nothing outside 64 bits: either raised only once training had started
        "--seed": {"least": 0}, "--init-seed": {"least": -(2**63), "most": 2**64 - 1},
    }
    for flag, bound in bounds.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        why = out_of_bounds(value, **bound)
        if why is not None:
            raise ConfigError(f"{flag} {why}, got {value}")
    if args.regroup_timeout <= args.collective_timeout:
        raise ConfigError("--regroup-timeout must exceed --collective-timeout")
    if args.ckpt not in ("none", "torch-save", "memory"):
        raise ConfigError(f"--ckpt {args.ckpt!r}: choose none, torch-save or memory")
    if args.stop_snapshot not in ("on", "off"):
        raise ConfigError(f"--stop-snapshot {args.stop_snapshot!r}: choose on or off")
    if not 0 < args.heartbeat_interval < args.heartbeat_window:
        raise ConfigError("--heartbeat-interval must be > 0 and below --heartbeat-window")
    sched = ScheduleConfig(
        micro_batches=args.global_batch_size // args.micro_batch_size, blocks=args.blocks,
        micro_batch_size=args.micro_batch_size, iterations=args.iterations, deterministic=args.deterministic,
        bucket_elems=args.bucket_elems, recovery=args.recovery, seed=args.seed, iter_sleep=args.iter_sleep,
        join_timeout_s=args.join_timeout, manual_gc_interval=args.manual_gc_interval,
        log_iterations=args.log_iterations,
    )
    comm = CommSettings(
        collective_timeout_s=args.collective_timeout, regroup_timeout_s=args.regroup_timeout,
        heartbeat_window_s=args.heartbeat_window, backend=args.backend,
        device=rank_device(args.device, args.backend, _env_int("LOCAL_RANK", 0)),
    )
    optim = OptimConfig(lr=args.lr)
    optim.validate()
    return optim, sched, comm


def training_data(
    provider: DatasetsProvider[BatchT], args: argparse.Namespace, sched: ScheduleConfig,
) -> MicroBatches[BatchT]:
    """Call the datasets provider and take the training micro-batches from what it returns."""
    ctx = DataContext(args=args, micro_batch_size=sched.micro_batch_size, micro_batches=sched.micro_batches,
                      iterations=sched.iterations, seed=sched.seed, tp=args.tp)
    got = provider(ctx)
    if isinstance(got, tuple):
        if len(got) != 3 or got[1] is not None or got[2] is not None:
            raise ConfigError("train_valid_test_datasets_provider returned a tuple: give (train, None, None); "
                              "validation and test sets are not run by the runtime")
        got = got[0]
    if not callable(getattr(got, "batch", None)):
        raise ConfigError(f"train_valid_test_datasets_provider returned {type(got).__name__}: it must have "
                          "batch(iteration, mb) (see unicron.runtime.data)")
    return got


def build(args: argparse.Namespace, providers: Providers[BatchT], model_type: ModelType) -> Rank[BatchT]:
    """Validate ``args`` and the environment, connect to the store and the agent, build the Trainer.
    Raises ConfigError / TemporaryError with a message naming the flag or variable."""
    if model_type is not ModelType.encoder_or_decoder:
        raise ConfigError(f"model_type {model_type!r}: only ModelType.encoder_or_decoder is supported")
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    host, port = os.environ.get("MASTER_ADDR", ""), _env_int("MASTER_PORT")
    topo = Topology(world, args.tp)
    if not 0 <= rank < world:
        raise ConfigError(f"RANK={rank} is outside WORLD_SIZE={world}")
    if args.out_dir:  # written only when the rank ends: a bad path must not surface after the training
        try:
            os.makedirs(args.out_dir, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--out-dir {args.out_dir!r}: {exc.strerror}; name a directory this user can write") \
                from exc
    optim_cfg, sched, comm = configs(args)
    client = AgentClient.from_env()  # its variables checked before the heartbeat process is forked
    job = Job(model_provider=providers.model, forward_step=providers.forward_step,
              data=training_data(providers.datasets, args, sched), args=args, init_seed=args.init_seed)
    heartbeat = Heartbeat(host, port, rank, interval_s=args.heartbeat_interval, world=world,
                          asking=membership.asking_to_join).start()  # forks
    try:
        store = keys.connect(host, port)
        torch.set_num_threads(args.threads)
        ensure_torch_distributed()
        checkpointer = make_checkpointer(args.ckpt, args.ckpt_dir, os.environ.get("UNICRON_TASK", ""), rank,
                                         storage=args.ckpt_storage, persist_every=args.ckpt_persist_every,
                                         world_size=world)
        store_epoch = _env_int(protocol.ENV_STORE_EPOCH, 0)
        if store_epoch and not membership.await_seeded(store, comm.regroup_timeout_s):
            raise TemporaryError(f"the task's store moved (store epoch {store_epoch}) and no survivor re-seeded "
                                 f"it within {comm.regroup_timeout_s:.0f}s")
        incarnation = int(store.add(keys.started_key(rank), 1))  # after the re-seed: it counts earlier ones
        address = keys.publish_host(store, rank, incarnation, host, port)
    except BaseException:
        heartbeat.stop()
        raise
    client.connect()
    client.install_excepthook()
    trainer = Trainer(
        rank=rank, topo=topo, store=store, incarnation=incarnation, job=job, optim_cfg=optim_cfg,
        sched=sched, comm=comm, client=client,
        faults=FaultScript.from_env(rank, incarnation, store), checkpointer=checkpointer,
        ckpt_every=args.ckpt_every, resume=args.resume, watcher=heartbeat,
        preemption=Preemption(snapshot=args.stop_snapshot == "on"), store_host=host, store_epoch=store_epoch,
        address=address,
    )
    return Rank(trainer, heartbeat, client)


def run(args: argparse.Namespace, providers: Providers[BatchT], model_type: ModelType, prog: str) -> int:
    """Build the rank and train; errors in the flags or the environment are one line on stderr."""
    try:
        ulog.configure(os.environ.get("UNICRON_LOG_LEVEL", "WARNING"))
        built = build(args, providers, model_type)
    except (ConfigError, TemporaryError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    trainer, heartbeat, client = built.trainer, built.heartbeat, built.client
    try:
        code = trainer.run()
    except PermanentError as exc:
        client.report_exception(exc, fatal=True)
        print(f"{prog}: rank {trainer.rank}: {exc}", file=sys.stderr)
        code = 1
    finally:
        heartbeat.stop()
        if args.out_dir:
            trainer.write_outputs(args.out_dir)
    client.close()
    return code
