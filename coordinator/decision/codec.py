"""JSON for events and actions (trace files, logs, the daemon's action records)."""

from __future__ import annotations

import enum
import typing
from dataclasses import fields
from typing import Any

from coordinator.decision.actions import (
    Action,
    Alert,
    Assign,
    IsolateNode,
    MarkTaskFailed,
    Reattempt,
    ResizeInPlace,
    RestartRanks,
    RestartTask,
    StopTask,
)
from coordinator.decision.events import (
    ActionFailed,
    ActionSucceeded,
    Event,
    FailureCause,
    IncidentRaised,
    NodeDrained,
    NodeForgotten,
    NodeJoined,
    NodeLost,
    NodeUndrained,
    ProgressMade,
    TaskCancelled,
    TaskFinished,
    TaskStopped,
    TaskSubmitted,
    TaskUpdated,
    Tick,
)
from coordinator.tasks import TaskSpec, parse_task_spec
from unicron.kernel.errors import InvalidRecord
from unicron.kernel.types import Incident, conforms

_EVENT_TYPES: dict[str, type[Any]] = {
    c.__name__: c
    for c in (
        IncidentRaised,
        NodeJoined,
        NodeLost,
        NodeDrained,
        NodeUndrained,
        NodeForgotten,
        TaskSubmitted,
        TaskUpdated,
        TaskFinished,
        TaskStopped,
        TaskCancelled,
        ActionSucceeded,
        ActionFailed,
        ProgressMade,
        Tick,
    )
}
_ACTION_TYPES: dict[str, type[Any]] = {
    c.__name__: c
    for c in (Reattempt, RestartRanks, RestartTask, IsolateNode, Assign, ResizeInPlace, StopTask, MarkTaskFailed,
              Alert)
}


def to_dict(item: Event | Action) -> dict[str, object]:
    """An event or action as JSON-ready data, with its class name under ``type``."""
    out: dict[str, object] = {"type": type(item).__name__}
    for f in fields(item):
        value = getattr(item, f.name)
        if isinstance(value, enum.Enum):
            value = value.value
        elif isinstance(value, Incident | TaskSpec):
            value = value.to_dict()
        elif isinstance(value, tuple):
            value = list(value)
        elif f.name in _PLACEMENTS:
            if f.name in _OMITTED_WHEN_EMPTY and not value:
                continue
            value = {n: list(r) for n, r in value.items()}
        out[f.name] = value
    return out


def from_dict(data: object) -> Event | Action:
    """Inverse of :func:`to_dict`; raises InvalidRecord on anything malformed."""
    if not isinstance(data, dict) or not isinstance(data.get("type"), str):
        raise InvalidRecord("decision record: expected an object with a 'type'")
    cls = _EVENT_TYPES.get(data["type"]) or _ACTION_TYPES.get(data["type"])
    if cls is None:
        raise InvalidRecord(f"decision record: unknown type {data['type']!r}")
    raw = {k: v for k, v in data.items() if k != "type"}
    _check_fields(data["type"], raw)
    try:
        if "incident" in raw:
            raw["incident"] = Incident.from_dict(raw["incident"])
        if "spec" in raw:
            raw["spec"] = parse_task_spec(raw["spec"], None)
        for key in _PLACEMENTS & set(raw):
            raw[key] = {n: tuple(r) for n, r in raw[key].items()}
        if "cause" in raw:
            raw["cause"] = FailureCause(raw["cause"])
        for key in ("members", "failed_ranks", "ranks", "joiners", "leaving", "lost", "joined"):
            if key in raw:
                raw[key] = tuple(raw[key])
        result: Event | Action = cls(**raw)
    except InvalidRecord:
        raise
    except (TypeError, ValueError, AttributeError) as exc:
        raise InvalidRecord(f"decision record {data['type']}: {exc}") from exc
    return result


#: node -> ranks fields (tuples in an action, lists in JSON)
_PLACEMENTS = frozenset({"placement", "previous_placement"})

#: left out of a record while empty: a reader from before the field refuses unknown fields
_OMITTED_WHEN_EMPTY = frozenset({"previous_placement"})

#: fields read by their own parser, which checks them
_PARSED = frozenset({"incident", "spec", "cause"})

#: each record type's field types, by type name
_HINTS = {name: typing.get_type_hints(cls) for name, cls in {**_EVENT_TYPES, **_ACTION_TYPES}.items()}


def _check_fields(name: str, raw: dict[str, Any]) -> None:
    """Each field a JSON value of its type (``{"type": "Tick", "ts": "x"}`` decoded and then raised a
    TypeError inside the core). Unknown and missing fields are left to the constructor."""
    hints = _HINTS[name]
    for key, value in raw.items():
        hint = dict[str, list[int]] if key in _PLACEMENTS else hints.get(key)
        if hint is not None and key not in _PARSED and not conforms(value, hint):
            raise InvalidRecord(f"decision record {name}: {key}: bad value {value!r:.80} (expected {hint})")
