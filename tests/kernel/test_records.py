"""Records round-trip through JSON, and anything malformed is one InvalidRecord (never a bare ValueError)."""

from __future__ import annotations

import pytest

from unicron.kernel.errors import InvalidRecord
from unicron.kernel.types import NodeInfo, StoreAddress


def test_a_record_round_trips_through_json() -> None:
    addr = StoreAddress(task="t", generation=3, node="n0", host="10.0.0.1", port=29500)
    assert StoreAddress.from_json(addr.to_json()) == addr
    assert StoreAddress.from_json(addr.to_json().encode()) == addr


@pytest.mark.parametrize("raw", [b"\xff\xfe", "{", "[" * 100_000, "[]", '{"task": 1}'])
def test_malformed_json_is_invalid_record(raw: str | bytes) -> None:
    with pytest.raises(InvalidRecord):
        NodeInfo.from_json(raw)
