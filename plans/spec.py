"""The planner's JSON input (``unicron plan --input FILE``); docs/planner.md describes the format.

Every problem raises :class:`unicron.kernel.errors.InvalidRecord` naming the offending field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from plans.hardware import gpu_type
from plans.models import ModelSpec, gpt3
from plans.problem import ClusterSpec, TaskDemand, check_names
from plans.throughput import Calibration
from plans.waf import ReliabilityModel
from unicron.kernel import jsontext
from unicron.kernel.errors import InvalidRecord

_MODEL_FIELDS = {f.name for f in fields(ModelSpec)}
#: JSON nesting: an input nests 3 levels (input -> tasks -> task -> model); deeper is not an input, and
#: Python's parser would recurse once per level
MAX_INPUT_DEPTH = 8


@dataclass(frozen=True)
class PlanInput:
    """A parsed input file."""

    cluster: ClusterSpec
    """The cluster to plan for."""
    tasks: list[TaskDemand]
    """The tasks, in file order."""
    reliability: ReliabilityModel
    """Failure model for D_running."""
    unit: str
    """Allocation unit, "gpu" or "node"."""


def _object(where: str, value: Any, allowed: set[str], required: set[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidRecord(f"{where}: expected a JSON object, got {type(value).__name__}")
    unknown = set(value) - allowed
    if unknown:
        raise InvalidRecord(f"{where}: unknown field(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
    missing = required - set(value)
    if missing:
        raise InvalidRecord(f"{where}: missing field(s) {sorted(missing)}")
    return value


def _number(where: str, value: Any) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise InvalidRecord(f"{where}: expected a finite number, got {value!r}")
    return float(value)


def _model(where: str, value: Any) -> ModelSpec:
    if isinstance(value, str):
        return gpt3(value)
    raw = _object(where, value, _MODEL_FIELDS | {"preset"}, set())
    raw = dict(raw)
    preset = raw.pop("preset", None)
    if preset is not None:
        if not isinstance(preset, str):
            raise InvalidRecord(f"{where}.preset: expected a preset name, got {preset!r}")
        return replace(gpt3(preset), **raw)
    missing = _MODEL_FIELDS - {"name"} - set(raw)
    if missing:
        raise InvalidRecord(f'{where}: missing field(s) {sorted(missing)} (or give a "preset")')
    return ModelSpec(**raw)


def _calibration(where: str, value: Any) -> Calibration | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRecord(f"{where}: expected an object of GPU count -> FLOP/s, got {value!r}")
    measured = {}
    for key, flops in value.items():
        try:
            x = int(key)
        except ValueError:
            raise InvalidRecord(f"{where}: key {key!r} is not a GPU count") from None
        measured[x] = _number(f"{where}[{key}]", flops)
    return Calibration(measured)


_TASK_FIELDS = {
    "name",
    "model",
    "weight",
    "min_gpus",
    "current_gpus",
    "faulted",
    "transition_s",
    "calibration",
    "tp",
    "pp",
    "micro_batch",
    "max_gpus",
}


def _task(i: int, value: Any) -> TaskDemand:
    where = f"tasks[{i}]"
    raw = dict(_object(where, value, _TASK_FIELDS, {"name", "model"}))
    raw["model"] = _model(f"{where}.model", raw["model"])
    raw["calibration"] = _calibration(f"{where}.calibration", raw.get("calibration"))
    if "faulted" in raw and not isinstance(raw["faulted"], bool):
        raise InvalidRecord(f"{where}.faulted: expected true or false, got {raw['faulted']!r}")
    for key in ("weight", "transition_s"):
        if key in raw:
            raw[key] = _number(f"{where}.{key}", raw[key])
    return TaskDemand(**raw)


def parse(data: Any) -> PlanInput:
    """Validate a decoded JSON document."""
    top = _object("input", data, {"cluster", "tasks", "reliability", "unit"}, {"cluster", "tasks"})
    c = _object("cluster", top["cluster"], {"gpu_type", "n_gpus", "gpus_per_node"}, {"gpu_type", "n_gpus"})
    if not isinstance(c["gpu_type"], str):
        raise InvalidRecord(f"cluster.gpu_type: expected a name, got {c['gpu_type']!r}")
    cluster = ClusterSpec(gpu_type(c["gpu_type"]), c["n_gpus"], c.get("gpus_per_node", 8))
    if not isinstance(top["tasks"], list):
        raise InvalidRecord("tasks: expected a list of task objects")
    tasks = [_task(i, t) for i, t in enumerate(top["tasks"])]
    check_names(tasks)
    r = _object(
        "reliability", top.get("reliability", {}), {"gpu_failure_rate_per_hour", "prior_gpu_hours"}, set()
    )
    reliability = ReliabilityModel(**{k: _number(f"reliability.{k}", v) for k, v in r.items()})
    unit = top.get("unit", "gpu")
    if unit not in ("gpu", "node"):
        raise InvalidRecord(f'unit: expected "gpu" or "node", got {unit!r}')
    return PlanInput(cluster, tasks, reliability, unit)


def load(path: str | Path) -> PlanInput:
    """Read and validate an input file."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise InvalidRecord(f"--input: cannot read {path}: {exc.strerror}") from exc
    where = f"--input {path}"
    return parse(jsontext.loads(jsontext.decode(raw, where), where, MAX_INPUT_DEPTH))
