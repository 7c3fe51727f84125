"""JSON text from outside (a spec file, an RPC's spec, the planner's input), decoded and parsed with
bounds: every problem is one :class:`InvalidRecord` line naming where the text came from, never a
traceback (a byte that is not UTF-8, an integer over Python's 4300 digits, a nesting that would recurse
once per level in the parser).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from typing import Any

from unicron.kernel.errors import InvalidRecord

#: a JSON string literal (escapes included), whose brackets are not nesting
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')


def decode(raw: bytes, where: str) -> str:
    """``raw`` as UTF-8 text; :class:`InvalidRecord` naming the first bad byte."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRecord(
            f"{where}: not UTF-8 text (byte {raw[exc.start]:#04x} at offset {exc.start}); save it as UTF-8"
        ) from exc


def max_depth(text: str) -> int:
    """The deepest nesting of ``[``/``{`` outside strings (an upper bound for malformed text)."""
    depth = deepest = 0
    for ch in re.findall(r"[\[\]{}]", _JSON_STRING.sub("", text)):
        if ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def loads(text: str, where: str, depth_limit: int) -> Any:
    """``json.loads(text)`` of what a person wrote (a task spec, a planner input): refusing nesting
    deeper than ``depth_limit`` before parsing, and a key given twice in one object (JSON keeps the
    last one silently: a spec copied and edited would run under the name it was copied from)."""
    depth = max_depth(text)
    if depth > depth_limit:
        raise InvalidRecord(f"{where}: nested deeper than {depth_limit} levels ({depth})")
    return parse(text, where, functools.partial(_unique_keys, where))


def _unique_keys(where: str, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise InvalidRecord(f"{where}: key {key!r} is given twice in one object; keep one")
        out[key] = value
    return out


def parse(raw: str | bytes | bytearray, where: str,
          object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None) -> Any:
    """``json.loads(raw)`` of text or bytes from outside (a peer's message, a file another process
    wrote): anything :func:`json.loads` cannot turn into a value is one :class:`InvalidRecord`."""
    try:
        return json.loads(raw, object_pairs_hook=object_pairs_hook)
    except json.JSONDecodeError as exc:
        raise InvalidRecord(f"{where}: not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from exc
    except UnicodeDecodeError as exc:
        raise InvalidRecord(f"{where}: not UTF-8 text (offset {exc.start}: {exc.reason})") from exc
    except ValueError as exc:  # an integer literal of more than 4300 digits (Python's int limit)
        raise InvalidRecord(f"{where}: not a usable JSON number: {str(exc).split(';')[0]}") from exc
    except RecursionError as exc:  # the parser recurses once per level of nesting
        raise InvalidRecord(f"{where}: nested too deep to parse") from exc
