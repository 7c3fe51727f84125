"""Hypothesis strategies for the fuzz targets, built from the real dataclasses.

Three kinds of input per target: random bytes, random JSON values, and structured mutations of a valid
message or record (one field anywhere in it, nested ones included, replaced by a random JSON value,
deleted, or joined by an unknown field). A valid value is generated from the dataclass's own type hints,
so a field added to a record is fuzzed without touching this file.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import json
import types
import typing
from typing import Any

from hypothesis import strategies as st

from coordinator.decision.actions import ActionKind
from coordinator.decision.state import CoreState, NodeEntry, NodeState, Outstanding, TaskEntry, TaskPhase
from coordinator.tasks import NAME_RE
from unicron.kernel import link, protocol
from unicron.kernel.inject import MAX_SLOW_ITERATIONS, Injection
from unicron.kernel.types import NodeInfo, RankSet, Record

#: numbers Python's JSON parser reads that no field should take: beyond a float, NaN, 4300+ digits
EDGE_NUMBERS = st.sampled_from([10**400, -(10**400), 2**63, -1, 0, float("nan"), float("inf"), float("-inf"),
                                1e308, 5e-324, True, False])
JSON_SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20) | EDGE_NUMBERS
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)

#: byte strings a peer or a corrupted etcd value might hold
RAW_BYTES = st.one_of(
    st.binary(max_size=200),
    st.integers(1, 20_000).map(lambda n: b"[" * n),  # nesting: Python's parser recurses per level
    st.integers(4301, 6000).map(lambda n: b"1" * n),  # an int over Python's digit limit
    st.sampled_from([b"NaN", b"-Infinity", b"1e999", b"\xff\xfe", b"{}", b"[]", b'""', b"null", b'{"type":null}']),
    JSON_VALUES.map(lambda v: json.dumps(v).encode()),
)

# --- valid values from type hints --------------------------------------------------------------------

_TEXT = st.text(max_size=12)
#: values a field must hold for the dataclass to build at all (its __post_init__ checks them)
OVERRIDES: dict[tuple[type[Any], str], st.SearchStrategy[Any]] = {
    (protocol.Phase, "name"): st.sampled_from(protocol.PHASES),
    (link.LinkHello, "node"): st.text(min_size=1, max_size=12),
    (NodeInfo, "gpus"): st.integers(0, 16),
    (NodeInfo, "replica_addr"): st.sampled_from(["", "10.0.0.2:7000", "[::1]:7001", "node-1:65535"]),
    (Injection, "iterations"): st.integers(1, MAX_SLOW_ITERATIONS),
    (Injection, "delay_s"): st.floats(0.0, 3600.0),
    # sorted, disjoint ranges, as RankSet.of builds them (arbitrary nested lists are invalid ones)
    (RankSet, "ranges"): st.lists(st.integers(0, 64), max_size=8).map(lambda rs: RankSet.of(rs).ranges),
}


def for_hint(hint: Any) -> st.SearchStrategy[Any]:
    """A strategy of valid in-memory values of ``hint`` (finite floats; enums as members)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return JSON_VALUES
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*(for_hint(a) for a in args))
    if hint is type(None):
        return st.none()
    if hint is bool:
        return st.booleans()
    if hint is int:
        return st.integers(-(2**40), 2**40)
    if hint is float:
        return st.floats(allow_nan=False, allow_infinity=False)
    if hint is str:
        return _TEXT
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return st.sampled_from(list(hint))
    if isinstance(hint, type) and issubclass(hint, Record):
        return record(hint)
    if origin in (list, tuple):
        return st.lists(for_hint(args[0] if args else Any), max_size=3)
    if origin is dict:
        return st.dictionaries(for_hint(args[0]), for_hint(args[1]), max_size=3)
    raise TypeError(f"no strategy for {hint!r}")


def _deferred(hint: Any) -> st.SearchStrategy[Any]:
    """Built on first draw: records nest (NodeAssignment -> TaskAssignment -> RankSpec)."""
    return st.deferred(lambda: for_hint(hint))


def record(cls: type[Any]) -> st.SearchStrategy[Any]:
    """Valid instances of a Record dataclass, every field drawn from its type hint."""
    hints = typing.get_type_hints(cls)
    kwargs = {f.name: OVERRIDES[(cls, f.name)] if (cls, f.name) in OVERRIDES else _deferred(hints[f.name])
              for f in dataclasses.fields(cls)}
    return st.builds(cls, **kwargs)


# --- structured mutation -----------------------------------------------------------------------------

Path = tuple[str | int, ...]
OPS = ("keep", "replace", "delete", "add")


def _paths(obj: Any, prefix: Path = ()) -> list[Path]:
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, (*prefix, i))
    return out


def _apply(obj: Any, path: Path, op: str, value: Any) -> tuple[Any, str]:
    """``obj`` with ``op`` done at ``path``; and the names on that path, comma-separated (a rejection
    must name one of them: the field, or the record field holding the mapping whose key was touched)."""
    if op == "keep":
        return obj, ""
    out = copy.deepcopy(obj)
    if not path:
        return (value, "") if op == "replace" else (out, "")
    parent = out
    for step in path[:-1]:
        parent = parent[step]
    last = path[-1]
    name = ",".join(p for p in path if isinstance(p, str))
    if op == "replace":
        parent[last] = value
    elif op == "delete":
        if not isinstance(parent, dict):
            return out, ""
        del parent[last]
    elif op == "add":
        target = parent[last]
        if not isinstance(target, dict):
            return out, ""
        target["zz_unknown"] = value
        name = f"{name},zz_unknown"
    return out, name


def record_paths(rec: Record, prefix: Path = ()) -> list[Path]:
    """Where in ``rec.to_dict()`` records are: the top, and each one nested in a field, a list or a dict."""
    out = [prefix]
    for f in dataclasses.fields(rec):  # type: ignore[arg-type]
        value = getattr(rec, f.name)
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        if isinstance(value, Record):
            out += record_paths(value, (*prefix, f.name))
        for key, item in items:
            if isinstance(item, Record):
                out += record_paths(item, (*prefix, f.name, key))
    return out


def with_field(obj: dict[str, Any], path: Path, name: str, value: Any) -> dict[str, Any]:
    """A copy of ``obj`` whose object at ``path`` has one more field, ``name``."""
    out = copy.deepcopy(obj)
    target: Any = out
    for step in path:
        target = target[step]
    target[name] = value
    return out


def mutated(valid: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[tuple[Any, str]]:
    """(a valid JSON object with one mutation anywhere in it, the field name the mutation touched)."""
    return valid.flatmap(
        lambda obj: st.tuples(st.sampled_from(_paths(obj)), st.sampled_from(OPS), JSON_VALUES).map(
            lambda t: _apply(obj, *t)
        )
    )


def inputs(valid: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[tuple[str, Any, str]]:
    """(kind, input, field): kind "bytes" (input: bytes), "json" (any JSON value) or "mutation"."""
    return st.one_of(
        RAW_BYTES.map(lambda b: ("bytes", b, "")),
        JSON_VALUES.map(lambda v: ("json", v, "")),
        mutated(valid).map(lambda m: ("mutation", m[0], m[1])),
    )


# --- the targets' valid values -----------------------------------------------------------------------

RANK_MESSAGES = st.sampled_from(sorted(protocol.MESSAGE_TYPES.values(), key=lambda c: c.TYPE)).flatmap(
    lambda cls: record(cls).map(lambda m: m.to_wire())
)
LINK_MESSAGES = st.sampled_from([link.LinkHello, link.Welcome, link.Heartbeat, link.Goodbye]).flatmap(
    lambda cls: record(cls).map(lambda m: m.to_wire())
)


def _os_text(min_size: int = 0) -> st.SearchStrategy[str]:
    return st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\0"), min_size=min_size,
                   max_size=12)


# layers even and heads a multiple of 4: every TP (1, 2, 4) and PP (1, 2) size drawn below divides them
_MODEL = st.fixed_dictionaries(
    {"num_layers": st.integers(1, 48).map(lambda k: 2 * k), "num_attention_heads": st.sampled_from([4, 8, 16]),
     "seq_length": st.integers(1, 4096), "vocab_size": st.integers(1, 60000)},
).flatmap(lambda m: st.fixed_dictionaries({
    "hidden_size": st.integers(1, 64).map(lambda k: k * m["num_attention_heads"]),
    "global_batch_size": st.sampled_from([64, 128, 512]), "micro_batch_size": st.sampled_from([1, 2, 4]),
}).map(lambda rest: {**m, **rest}))


def _spec(tp: int, pp: int) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(
        {"name": st.from_regex(NAME_RE, fullmatch=True),
         "command": st.one_of(st.lists(_os_text(1), min_size=1, max_size=3), st.just("python -m train --x 1"))},
        optional={"weight": st.floats(0.5, 2.0), "tp_size": st.just(tp), "pp_size": st.just(pp),
                  "min_gpus": st.sampled_from([1, 2, 4]),  # the data-parallel size: see _gpus
                  "model": _MODEL, "env": st.dictionaries(_os_text(1).filter(lambda k: "=" not in k), _os_text(),
                                                          max_size=2)},
    ).map(_gpus)


def _gpus(spec: dict[str, Any]) -> dict[str, Any]:
    """``min_gpus`` as the drawn data-parallel size times the TP and PP sizes *the spec states* (absent:
    1). Scaled by the drawn ones, a spec without them asked for a data-parallel size of up to 32, which
    divides no batch of 16 micro-batches: an invalid base, whose rejection named another field than the
    mutated one (a CI flake of test_api_answers_fuzzed_specs...)."""
    if "min_gpus" in spec:
        spec["min_gpus"] *= spec.get("tp_size", 1) * spec.get("pp_size", 1)
    return spec


#: valid task specs (before mutation): a data-parallel size of 1, 2 or 4 divides every batch drawn here,
#: so a rejection is always for the mutated field
SPECS = st.tuples(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2])).flatmap(lambda t: _spec(*t))

_OUTSTANDING = st.builds(Outstanding, st.text(max_size=8), st.sampled_from(list(ActionKind)),
                         st.floats(0, 1e9), st.none() | _TEXT, st.lists(_TEXT, max_size=2))
_RANKS = st.lists(st.integers(0, 64), max_size=3)


def _task_entry() -> st.SearchStrategy[TaskEntry]:
    from coordinator.tasks import parse_task_spec

    return st.builds(
        TaskEntry,
        spec=st.builds(lambda name: parse_task_spec({"name": name, "command": ["python", "train.py"]}, None),
                       st.from_regex(NAME_RE, fullmatch=True)),
        phase=st.sampled_from(list(TaskPhase)), generation=st.integers(0, 99), restart_epoch=st.integers(0, 9),
        regroup_epoch=st.integers(0, 9), placement=st.dictionaries(_TEXT, _RANKS, max_size=2),
        last_step=st.none() | st.integers(0, 10**6), outstanding=st.none() | _OUTSTANDING,
        reattempts=st.integers(0, 3), fault_node=st.none() | _TEXT, failed_ranks=_RANKS,
        relaunching=st.dictionaries(_TEXT, _RANKS, max_size=2), recovery_step=st.none() | st.integers(0, 99),
        restarts=st.integers(0, 3), no_progress_since=st.none() | st.integers(0, 99), reason=_TEXT,
        submitted_at=st.floats(0, 2e9),
    )


CORE_STATES = st.builds(
    CoreState, now=st.floats(0, 2e9), counter=st.integers(0, 10**6),
    nodes=st.dictionaries(_TEXT, st.builds(NodeEntry, st.integers(0, 8), st.sampled_from(list(NodeState)), _TEXT),
                          max_size=3),
    # keyed by the spec's name, as the core keeps them (another key is refused as damage)
    tasks=st.lists(_task_entry(), max_size=2).map(lambda entries: {e.spec.name: e for e in entries}),
).map(lambda s: s.to_dict())
