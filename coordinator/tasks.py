"""The task set (paper §3.2 "Training Task Management", §5.1 T_necessary and w(t)).

A task is what a user submits: a name, the command that launches its Megatron training, a weight (the
paper's priority w(t), recommended 0.5-2.0, default 1), a minimum requirement (the paper's
T_necessary: the fewest GPUs it may run on), the parallelism that constrains how its GPUs can be cut
(tensor-parallel groups stay inside a node), a model description for the throughput model, and env.

``load_spec_json`` then ``parse_task_spec`` are the only way in from untrusted JSON: every problem
raises :class:`unicron.kernel.errors.InvalidRecord` whose one-line message names the field and says
what to do. Validation refuses what would fail later, where it is costly: whatever ``execve()`` refuses
(a NUL byte, '=' in an env name, too many argv/env bytes) would otherwise preempt running tasks for a
task that cannot start, and an oversize spec would be refused by etcd after the coordinator decided.
"""

from __future__ import annotations

import enum
import math
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from plans.models import MODEL_LIMITS
from unicron.kernel import jsontext, patterns
from unicron.kernel.errors import ConfigError, InvalidRecord

#: a task name must be one etcd key segment and one file name (no '/', NUL, '.', '..'), and a DNS label
NAME_RE = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
MIN_WEIGHT = 0.5
MAX_WEIGHT = 2.0
#: The spec's JSON text, in UTF-8 bytes. Real specs are a few KiB; the coordinator stores the spec in
#: one etcd write, and etcd refuses requests over 1.5 MiB by default (``--max-request-bytes``).
MAX_SPEC_BYTES = 256 * 1024
#: JSON nesting: a spec nests 2 levels (task -> model/env/command); deeper is not a spec, and
#: Python's parser would recurse once per level.
MAX_SPEC_DEPTH = 8
#: argv plus env of one rank, as execve() counts them (each string with its NUL terminator). Linux
#: refuses one string over 128 KiB (MAX_ARG_STRLEN) and all together over ARG_MAX (2 MiB usually),
#: which the agent's own environment shares. Stored as JSON this is at most 6x (a control character
#: becomes \u00XX), still under etcd's request limit.
MAX_LAUNCH_BYTES = 128 * 1024
_SHOWN = 60  # characters of a bad value quoted in an error message


class Recovery(enum.StrEnum):
    """How a task recovers from a rank's failure or hang (sev2 / sev3)."""

    INPROCESS = "inprocess"
    """The task runs on Unicron's runtime (``unicron train``, ``unicron.runtime``): reattempt in place,
    relaunch of the failed ranks only, redistribution. Its ranks can take a relaunched peer back."""
    RESTART = "restart"
    """Any other job (a stock torchrun script): every rank is stopped and all are relaunched together,
    with ``TORCHELASTIC_RESTART_COUNT`` one higher; the job resumes from its own checkpoint."""


def default_recovery(command: tuple[str, ...]) -> Recovery:
    """``inprocess`` for a command that runs Unicron's runtime, else ``restart``.

    A stock script cannot take a relaunched peer back, so ``restart`` is the safe default; the runtime's
    ranks (``unicron train`` or ``python -m unicron.runtime.*``) can, and keep their faster recovery
    without every spec having to say so.
    """
    if any(a.startswith("unicron.runtime") for a in command):
        return Recovery.INPROCESS
    if len(command) > 1 and command[0].rsplit("/", 1)[-1] == "unicron" and command[1] == "train":
        return Recovery.INPROCESS
    return Recovery.RESTART


@dataclass(frozen=True)
class ModelDescription:
    """What the throughput model T(t, x) needs to know about a task's model (GPT-style decoder)."""

    num_layers: int
    """Transformer layers."""
    hidden_size: int
    """Hidden dimension; must be divisible by ``num_attention_heads``."""
    num_attention_heads: int
    """Attention heads."""
    seq_length: int
    """Tokens per sample."""
    vocab_size: int
    """Vocabulary size (before padding)."""
    global_batch_size: int
    """Samples per optimizer step, summed over data-parallel ranks."""
    micro_batch_size: int = 1
    """Samples per micro-batch; ``global_batch_size`` must be a multiple of it."""

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class TaskSpec:
    """One training task of the task set. Build it with :func:`parse_task_spec`, which validates."""

    name: str
    """Identifier; ``[a-z0-9][a-z0-9-]{0,62}`` so that it can be one etcd key segment."""
    command: tuple[str, ...]
    """argv that launches one rank of the task's Megatron training (the agent adds rank/world env)."""
    weight: float = 1.0
    """The paper's w(t): priority, in [0.5, 2.0]."""
    min_gpus: int = 1
    """The paper's T_necessary(t): the task is only scheduled with at least this many GPUs."""
    tp_size: int = 1
    """Tensor-parallel size; each TP group must sit inside one node, so it must divide GPUs per node."""
    pp_size: int = 1
    """Pipeline-parallel size; a task's GPU count is always a multiple of ``tp_size * pp_size``."""
    model: ModelDescription | None = None
    """For the throughput model; ``None`` means throughput is taken as linear in GPUs."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment variables for every rank."""
    recovery: Recovery | None = None
    """How a rank's failure is recovered; ``None`` (not given) resolves to :func:`default_recovery`."""
    max_gpus: int | None = None
    """The most GPUs the task is given (its world size stays in [``min_gpus``, ``max_gpus``]). Not given:
    a ``restart`` task runs at exactly ``min_gpus`` (a stock script's data split and batch assume its
    world size, so it is elastic only when it says so); an ``inprocess`` task has no limit (Unicron's
    runtime resizes in place)."""

    def __post_init__(self) -> None:
        if self.recovery is None:  # frozen: the resolved default is set once, here
            object.__setattr__(self, "recovery", default_recovery(self.command))
        if self.max_gpus is None and self.recovery is Recovery.RESTART:
            object.__setattr__(self, "max_gpus", self.min_gpus)

    @property
    def restarts_whole(self) -> bool:
        """Whether every rank is relaunched on a rank's failure (``recovery: "restart"``)."""
        return self.recovery is Recovery.RESTART

    @property
    def unit(self) -> int:
        """GPUs per model replica: counts are multiples of this (one data-parallel rank more or less)."""
        return self.tp_size * self.pp_size

    def valid_count(self, gpus: int) -> bool:
        """Whether the task can run on exactly ``gpus`` GPUs (0 = not running is always valid)."""
        if gpus == 0:
            return True
        if gpus < self.min_gpus or gpus % self.unit:
            return False
        if self.max_gpus is not None and gpus > self.max_gpus:
            return False
        if self.model is None:
            return True
        dp = gpus // self.unit
        # Megatron needs global batch = micro batch * DP * accumulation steps
        return self.model.global_batch_size % (self.model.micro_batch_size * dp) == 0

    def launch_changes(self, new: TaskSpec) -> list[str]:
        """The fields of ``new`` that change how the task's ranks are launched (its command, their
        environment, the recovery mode, TP x PP or the micro-batch size): the running ranks must stop
        and be relaunched to take them. Weight and GPU bounds are not among them: a re-plan is enough."""
        old_mbs = None if self.model is None else self.model.micro_batch_size
        new_mbs = None if new.model is None else new.model.micro_batch_size
        changed = [f for f in ("command", "env", "recovery", "tp_size", "pp_size") if getattr(self, f) != getattr(new, f)]
        return changed + (["model.micro_batch_size"] if old_mbs != new_mbs else [])

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "command": list(self.command),
            "weight": self.weight,
            "min_gpus": self.min_gpus,
            "tp_size": self.tp_size,
            "pp_size": self.pp_size,
            "model": None if self.model is None else self.model.to_dict(),
            "env": dict(self.env),
            "recovery": None if self.recovery is None else self.recovery.value,
            "max_gpus": self.max_gpus,
        }

    @classmethod
    def from_dict(cls, data: Any) -> TaskSpec:
        return parse_task_spec(data, None)


#: the fields a task spec and its model description may have (a stored one with others came from a
#: newer version: coordinator/statestore.py leaves them out)
SPEC_FIELDS = frozenset(f.name for f in fields(TaskSpec))
MODEL_FIELDS = frozenset(f.name for f in fields(ModelDescription))
#: each model field's largest value: the planner's (``plans.models.MODEL_LIMITS``)
_MODEL_LIMITS = {
    "num_layers": MODEL_LIMITS["layers"],
    "hidden_size": MODEL_LIMITS["hidden"],
    "num_attention_heads": MODEL_LIMITS["heads"],
    "seq_length": MODEL_LIMITS["seq_len"],
    "vocab_size": MODEL_LIMITS["vocab"],
    "global_batch_size": MODEL_LIMITS["global_batch"],
    "micro_batch_size": MODEL_LIMITS["global_batch"],
}


def _show(value: Any) -> str:
    """``repr(value)``, cut short: an error message quotes the value, not a megabyte of it."""
    text = repr(value) if not isinstance(value, list | dict) else type(value).__name__
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."


def _positive_int(value: Any, where: str) -> int:
    # bool is an int in Python; "true" GPUs is a mistake worth naming
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRecord(f"{where}: expected a positive integer, got {_show(value)}")
    if value < 1:
        raise InvalidRecord(f"{where}: must be at least 1, got {value}")
    return value


def _parse_name(value: Any) -> str:
    if not isinstance(value, str) or not NAME_RE.fullmatch(value):
        raise InvalidRecord(
            f"task.name: {_show(value)} is not a valid task name; use 1-63 characters of lowercase letters, "
            "digits and '-', starting with a letter or digit"
        )
    return value


def _parse_command(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        try:
            argv = shlex.split(value)
        except ValueError as exc:
            raise InvalidRecord(f"task.command: cannot split {_show(value)} into arguments: {exc}") from exc
    elif isinstance(value, list | tuple):
        if not all(isinstance(a, str) for a in value):
            raise InvalidRecord("task.command: every argument must be a string")
        argv = list(value)
    else:
        raise InvalidRecord(
            f"task.command: expected a list of arguments or a command string, got {type(value).__name__}"
        )
    if not argv or not argv[0]:
        raise InvalidRecord("task.command: is empty; give the command that launches one training rank")
    for i, arg in enumerate(argv):
        _check_os_string(arg, f"task.command[{i}]")
    return tuple(argv)


def _check_os_string(value: str, where: str) -> None:
    """What the OS would refuse in one argv or env string: execve() takes NUL-terminated bytes."""
    if "\0" in value:
        raise InvalidRecord(f"{where}: contains a NUL byte (\\u0000), which no program argument or "
                            "environment variable can hold; remove it")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRecord(f"{where}: is not encodable as UTF-8 ({exc.reason} at {exc.start}); "
                            "use real characters, not lone \\ud800-\\udfff escapes") from exc


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond a float's range is no weight either
        return False


def _parse_weight(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not _finite(value):
        raise InvalidRecord(
            f"task.weight: expected a number in [{MIN_WEIGHT}, {MAX_WEIGHT}], got {_show(value)}"
        )
    if not MIN_WEIGHT <= value <= MAX_WEIGHT:
        raise InvalidRecord(
            f"task.weight: {value} is outside [{MIN_WEIGHT}, {MAX_WEIGHT}] (paper §5.1); "
            "use 1.0 for normal priority"
        )
    return float(value)


def _parse_env(value: Any, stored: bool = False) -> dict[str, str]:
    if not isinstance(value, dict):
        raise InvalidRecord(f"task.env: expected an object of string to string, got {type(value).__name__}")
    for k, v in value.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise InvalidRecord(f"task.env: entry {_show(k)}: names and values must be strings")
        if not k:
            raise InvalidRecord("task.env: a name is empty; give every variable a name")
        if "=" in k:
            raise InvalidRecord(f"task.env: name {_show(k)} contains '=', which ends a name in the environment")
        if "\0" in k:
            raise InvalidRecord(f"task.env: name {_show(k)} contains a NUL byte (\\u0000); remove it")
        _check_os_string(k, "task.env")
        _check_os_string(v, f"task.env.{k}")
        if k in patterns.JOB_REGEXES and v and not stored:  # a running task's spec loads as it was accepted
            try:
                patterns.compile_job_regex(k, v)
            except ConfigError as exc:  # the agent would ignore it: hangs and saves unseen
                raise InvalidRecord(f"task.env.{exc}") from exc
    return dict(value)


def _check_launch_size(command: tuple[str, ...], env: Mapping[str, str]) -> None:
    size = sum(len(a.encode()) + 1 for a in command)
    size += sum(len(k.encode()) + len(v.encode()) + 2 for k, v in env.items())
    if size > MAX_LAUNCH_BYTES:
        raise InvalidRecord(
            f"task.command, task.env: {size} bytes of arguments and environment (as execve counts them); "
            f"the limit is {MAX_LAUNCH_BYTES} (MAX_LAUNCH_BYTES); pass large inputs in a file instead"
        )


def load_spec_json(text: str, where: str = "task") -> Any:
    """Parse a spec's JSON text, refusing what is too big or too deep to be a spec before parsing it.

    ``where`` starts each error message (the CLI passes the file's name).
    """
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_SPEC_BYTES:
        raise InvalidRecord(
            f"{where}: the spec is {size} bytes; the limit is {MAX_SPEC_BYTES} (MAX_SPEC_BYTES); "
            "pass large inputs to the command in a file instead"
        )
    return jsontext.loads(text, where, MAX_SPEC_DEPTH)


def parse_model(data: Any) -> ModelDescription:
    """Validate a model description (the ``model`` field of a task)."""
    if not isinstance(data, dict):
        raise InvalidRecord(f"task.model: expected an object, got {type(data).__name__}")
    unknown = sorted(set(data) - MODEL_FIELDS)
    if unknown:
        raise InvalidRecord(f"task.model: unknown field(s) {unknown}; known: {sorted(MODEL_FIELDS)}")
    values: dict[str, int] = {}
    for f in fields(ModelDescription):
        if f.name in data:
            values[f.name] = _positive_int(data[f.name], f"task.model.{f.name}")
            limit = _MODEL_LIMITS[f.name]
            if values[f.name] > limit:
                raise InvalidRecord(f"task.model.{f.name}: must be at most {limit} (far above any real model)")
        elif f.name != "micro_batch_size":
            raise InvalidRecord(f"task.model.{f.name}: missing; the throughput model needs it")
    model = ModelDescription(**values)
    if model.hidden_size % model.num_attention_heads:
        raise InvalidRecord(
            f"task.model.hidden_size: {model.hidden_size} is not divisible by "
            f"num_attention_heads={model.num_attention_heads}"
        )
    if model.global_batch_size % model.micro_batch_size:
        raise InvalidRecord(
            f"task.model.global_batch_size: {model.global_batch_size} is not a multiple of "
            f"micro_batch_size={model.micro_batch_size}"
        )
    return model


def _parse_recovery(value: Any, command: tuple[str, ...]) -> Recovery:
    if value is None:
        return default_recovery(command)
    try:
        return Recovery(value)
    except ValueError:
        raise InvalidRecord(
            f"task.recovery: {_show(value)} is not one of {[r.value for r in Recovery]}; use \"restart\" for a "
            "stock script (all ranks relaunched from its checkpoint), \"inprocess\" for Unicron's runtime"
        ) from None


def _check_layout(model: ModelDescription, tp: int, pp: int) -> None:
    """What Megatron asserts of TP x PP, and the WAF planner's configuration search requires (else it
    gives the task 0 GPUs on every plan: pending for ever, blaming a lack of GPUs)."""
    if model.num_layers % pp:
        raise InvalidRecord(
            f"task.pp_size: {pp} does not divide model.num_layers={model.num_layers}; every pipeline stage "
            "needs the same number of layers"
        )
    if model.num_attention_heads % tp:
        raise InvalidRecord(
            f"task.tp_size: {tp} does not divide model.num_attention_heads={model.num_attention_heads}; "
            "each tensor-parallel rank needs whole heads"
        )


def _parse_max_gpus(value: Any, min_gpus: int, unit: int) -> int | None:
    if value is None:
        return None
    max_gpus = _positive_int(value, "task.max_gpus")
    if max_gpus < min_gpus:
        raise InvalidRecord(f"task.max_gpus: {max_gpus} is less than min_gpus {min_gpus}; raise it or lower min_gpus")
    if max_gpus % unit:
        raise InvalidRecord(
            f"task.max_gpus: {max_gpus} is not a multiple of tp_size*pp_size={unit}; use {max_gpus // unit * unit}"
        )
    return max_gpus


def parse_task_spec(
    data: Any, cluster_gpus: int | None, gpus_per_node: int | None = None, *, stored: bool = False
) -> TaskSpec:
    """Validate one task from JSON. ``cluster_gpus``/``gpus_per_node`` (if known) bound its demands.
    ``stored``: a spec the leader accepted earlier, read back from its state: the layout checks added
    since (:func:`_check_layout`) are skipped, so that one such task does not make the whole state
    unreadable (the leader would start afresh, forgetting every task).

    Raises :class:`InvalidRecord` naming the offending field and what to do.
    """
    if not isinstance(data, dict):
        raise InvalidRecord(f"task: expected a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - SPEC_FIELDS)
    if unknown:
        raise InvalidRecord(f"task: unknown field(s) {unknown}; known: {sorted(SPEC_FIELDS)}")
    for required in ("name", "command"):
        if required not in data:
            raise InvalidRecord(f"task.{required}: missing")
    name = _parse_name(data["name"])
    command = _parse_command(data["command"])
    weight = _parse_weight(data.get("weight", 1.0))
    tp = _positive_int(data.get("tp_size", 1), "task.tp_size")
    pp = _positive_int(data.get("pp_size", 1), "task.pp_size")
    unit = tp * pp
    min_gpus = _positive_int(data.get("min_gpus", unit), "task.min_gpus")
    if min_gpus % unit:
        raise InvalidRecord(
            f"task.min_gpus: {min_gpus} is not a multiple of tp_size*pp_size={unit}; "
            f"use {-(-min_gpus // unit) * unit}"  # integer ceiling: min_gpus may be beyond a float
        )
    if gpus_per_node is not None and gpus_per_node % tp:
        raise InvalidRecord(
            f"task.tp_size: {tp} does not divide the {gpus_per_node} GPUs per node; a tensor-parallel "
            "group must fit inside one node"
        )
    if cluster_gpus is not None and min_gpus > cluster_gpus:
        raise InvalidRecord(
            f"task.min_gpus: {min_gpus} is more than the cluster's {cluster_gpus} GPUs; lower it or add nodes"
        )
    model_raw = data.get("model")
    model = None if model_raw is None else parse_model(model_raw)
    env = _parse_env(data.get("env", {}), stored)
    _check_launch_size(command, env)
    recovery = _parse_recovery(data.get("recovery"), command)
    if model is not None and not stored:
        _check_layout(model, tp, pp)
    max_gpus = _parse_max_gpus(data.get("max_gpus"), min_gpus, unit)
    spec = TaskSpec(name, command, weight, min_gpus, tp, pp, model, env, recovery, max_gpus)
    if model is not None and not spec.valid_count(min_gpus):
        raise InvalidRecord(
            f"task.min_gpus: with {min_gpus} GPUs the data-parallel size {min_gpus // unit} does not divide "
            f"global_batch_size/micro_batch_size={model.global_batch_size // model.micro_batch_size}"
        )
    return spec
