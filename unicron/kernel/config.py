"""Settings dataclasses whose every field is a CLI flag with an environment-variable fallback.

Declare a field with :func:`setting`; :func:`add_arguments` turns the dataclass into argparse flags
whose help names the variable, and :func:`from_args` resolves flag > environment > default, with a
:class:`~unicron.kernel.errors.ConfigError` naming the flag and variable for a bad value.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import typing
from typing import Any, TypeVar

from unicron.kernel.errors import ConfigError

T = TypeVar("T")


def setting(default: Any, env: str, help: str, *, least: float | None = None, above: float | None = None,
            most: float | None = None) -> Any:
    """A settings field: ``default`` value, environment variable ``env``, and the flag's ``help``.

    A number may be bounded: ``least`` (>=), ``above`` (>), ``most`` (<=); :func:`from_args` refuses a
    value outside with one line naming the flag, before the daemon's ``validate``."""
    bounds = {"least": least, "above": above, "most": most}
    return dataclasses.field(default=default, metadata={"env": env, "help": help,
                                                        **{k: v for k, v in bounds.items() if v is not None}})


def out_of_bounds(value: float, *, least: float | None = None, above: float | None = None,
                  most: float | None = None) -> str | None:
    """Why ``value`` is outside the bounds (``"must be >= 0"``), None when inside: the one wording of
    a range error for the daemons' settings, the runtime's flags and the CLI's."""
    if least is not None and value < least:
        return f"must be >= {least}"
    if above is not None and value <= above:
        return f"must be > {above}"
    if most is not None and value > most:
        return f"must be <= {most}"
    return None


def _check_bounds(obj: object) -> None:
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        value, meta = getattr(obj, f.name), f.metadata
        why = out_of_bounds(value, least=meta.get("least"), above=meta.get("above"), most=meta.get("most"))
        if why is not None:
            raise ConfigError(f"{_flag(f.name)} / {meta.get('env')}: {value!r} {why}")


def finite_float(raw: str) -> float:
    """``float(raw)``, refusing NaN and infinities with ValueError: NaN passes every "must be > 0" check
    (a comparison with NaN is false) and then breaks a sleep or a deadline far from the flag."""
    value = float(raw)
    if not math.isfinite(value):
        raise ValueError("not a finite number")
    return value


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _convert(raw: str, kind: Any, where: str) -> Any:
    try:
        if kind is bool:
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError("expected true/false")
        if kind is float:
            return finite_float(raw)
        if kind in (int, str):
            return kind(raw)
    except ValueError as exc:
        raise ConfigError(f"{where}: bad value {raw!r} ({exc})") from exc
    raise ConfigError(f"{where}: unsupported setting type {kind}")


def add_arguments(parser: argparse.ArgumentParser, cls: type[Any]) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        env = f.metadata.get("env")
        if env is None:
            continue
        help_text = f"{f.metadata['help']} (env: {env}; default: {f.default!r})"
        if hints[f.name] is bool:
            parser.add_argument(_flag(f.name), dest=f.name, default=None, help=help_text,
                                action=argparse.BooleanOptionalAction)
        else:
            parser.add_argument(_flag(f.name), dest=f.name, default=None, help=help_text, metavar=f.name.upper())


def from_args(cls: type[T], args: argparse.Namespace | None = None, **overrides: Any) -> T:
    """Build ``cls`` from flags (``args``), then environment variables, then defaults."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        env = f.metadata.get("env")
        if f.name in overrides:
            values[f.name] = overrides[f.name]
            continue
        given = getattr(args, f.name, None) if args is not None else None
        where = f"{_flag(f.name)} / {env}"
        if given is not None:
            values[f.name] = given if isinstance(given, bool) else _convert(str(given), hints[f.name], where)
        elif env and env in os.environ:
            values[f.name] = _convert(os.environ[env], hints[f.name], where)
    obj = cls(**values)
    _check_bounds(obj)
    validate = getattr(obj, "validate", None)
    if callable(validate):
        validate()
    return obj
