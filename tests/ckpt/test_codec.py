"""State <-> (meta, data) bytes: every dtype and layout, aliasing, the unpickling allow-list."""

from __future__ import annotations

import collections
import io
import os
import pickle
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ckpt.api import CheckpointCorrupt, CheckpointError
from ckpt.codec import (
    _META_HEAD,
    _META_MAGIC,
    Destinations,
    copy_into,
    decode,
    encode,
    parse_safe_globals,
)
from tests.ckpt.helpers import assert_same


@dataclass
class DataPosition:
    epoch: int
    index: int


def roundtrip(state: Any, private: bool = False, **kw: Any) -> Any:
    enc = encode(state)
    data = torch.empty(enc.data_len, dtype=torch.uint8)
    assert copy_into(enc, data) is None  # CPU: copied synchronously, no event
    return decode(enc.meta, data, private=private, **kw)


def test_every_dtype_and_layout() -> None:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 5, generator=g)
    state = {
        **{
            str(dt): (base * 10).to(dt)
            for dt in (
                torch.float32,
                torch.float16,
                torch.bfloat16,
                torch.float64,
                torch.int8,
                torch.int16,
                torch.int32,
                torch.int64,
                torch.uint8,
                torch.bool,
                torch.complex64,
            )
        },
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "transposed": base.t(),
        "expanded": torch.arange(3.0).expand(4, 3),
        "sliced": base[1:5:2, ::2],
    }
    out = roundtrip(state)
    assert_same(state, out)


def test_same_tensor_twice_stays_one_tensor_and_data_is_not_aliased() -> None:
    w = torch.randn(4)
    enc = encode({"a": w, "b": [w]})
    data = torch.empty(enc.data_len, dtype=torch.uint8)
    copy_into(enc, data)
    out = decode(enc.meta, data, private=False)
    assert out["a"] is out["b"][0]
    data.fill_(0)  # the buffer (a shared-memory slot) gets overwritten by the next snapshot
    assert torch.equal(out["a"], w)


def test_python_numpy_and_containers() -> None:
    state = {
        "od": collections.OrderedDict(b=1, a=2),
        "dd": collections.defaultdict(list, {"x": [1]}),
        "np": np.arange(5, dtype=np.float32),
        "np_rng": np.random.default_rng(3).bit_generator.state,
        "legacy_rng": np.random.get_state(),
        "tuple": (1, "two", 3.0, None, b"bytes"),
        "set": {1, 2},
        "size": torch.Size([2, 3]),
        "dtype": torch.bfloat16,
        "device": torch.device("cpu"),
    }
    out = roundtrip(state)
    assert type(out["od"]) is collections.OrderedDict and list(out["od"]) == ["b", "a"]
    assert out["dd"]["missing"] == []
    assert_same(state["legacy_rng"], out["legacy_rng"])
    for k in ("np_rng", "tuple", "set", "size", "dtype", "device"):
        assert out[k] == state[k]


def test_unlisted_class_is_refused_until_allowed() -> None:
    state = {"pos": DataPosition(1, 42)}
    with pytest.raises(CheckpointCorrupt, match=f"{__name__}:DataPosition"):
        roundtrip(state)
    out = roundtrip(state, safe_globals=parse_safe_globals([f"{__name__}:DataPosition"]))
    assert out["pos"] == DataPosition(1, 42)


def test_forged_metadata_cannot_run_code(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, (f"touch {marker}",))

    body = io.BytesIO()
    pickle.dump({"x": Evil()}, body)
    table = b"[]"
    meta = _META_HEAD.pack(_META_MAGIC, len(table)) + table + body.getvalue()
    with pytest.raises(CheckpointCorrupt, match="not on the allow-list"):
        decode(meta, torch.empty(0, dtype=torch.uint8), private=True)
    assert not marker.exists()


def test_metadata_pointing_outside_data_is_corrupt() -> None:
    enc = encode({"w": torch.ones(100)})
    with pytest.raises(CheckpointCorrupt, match="outside the data"):
        decode(enc.meta, torch.empty(10, dtype=torch.uint8), private=True)
    with pytest.raises(CheckpointCorrupt, match="header unreadable"):
        decode(b"garbage" * 3, torch.empty(0, dtype=torch.uint8), private=True)


def test_unsupported_tensors_named() -> None:
    with pytest.raises(CheckpointError, match="only dense CPU or CUDA"):
        encode({"s": torch.eye(3).to_sparse()})
    with pytest.raises(CheckpointError, match="only dense CPU or CUDA"):
        encode({"m": torch.empty(3, device="meta")})


def test_into_fills_matching_tensors_and_keeps_the_rest() -> None:
    saved: dict[str, Any] = {"w": torch.arange(6.0).view(2, 3), "odd": torch.ones(2), "n": 5}
    live_w = torch.zeros(2, 3)
    live = {"w": live_w, "odd": torch.zeros(3)}  # shape differs: not filled, a new tensor instead
    out = roundtrip(saved, into=live)
    assert out["w"] is live_w and torch.equal(live_w, saved["w"])
    assert out["odd"] is not live["odd"] and torch.equal(out["odd"], saved["odd"])
    assert out["n"] == 5


def test_parallel_raw_copy_matches_values_including_lazy_views() -> None:
    big = torch.randn(5 << 20)  # 20 MiB: split into pieces shared by the workers
    z = torch.randn(8, dtype=torch.complex64)
    state = {
        "big": big,
        "conj": z.conj(),
        "neg": z.conj().imag,
        "small": torch.arange(7),
        "t": big[:64].view(8, 8).t(),
    }
    enc = encode(state)
    data = torch.empty(enc.data_len, dtype=torch.uint8)
    with ThreadPoolExecutor(2) as pool:
        copy_into(enc, data, None, pool, workers=2)
    out = decode(enc.meta, data, private=True)
    for k, v in state.items():
        assert torch.equal(out[k], v.resolve_conj().resolve_neg()), k


def test_destination_views_are_kept_while_buffer_and_layout_stay_and_rebuilt_when_either_changes() -> None:
    dests = Destinations()
    a, b = torch.zeros(256, dtype=torch.uint8), torch.zeros(256, dtype=torch.uint8)
    layout = encode({"w": torch.ones(4, 3), "i": torch.arange(5)}).entries
    first = dests.views(a, layout)
    assert [(v.dtype, tuple(v.shape)) for v in first] == [(torch.float32, (4, 3)), (torch.int64, (5,))]
    assert first[0].data_ptr() == a.data_ptr() and first[1].data_ptr() == a.data_ptr() + layout[1].offset
    again = dests.views(a, encode({"w": torch.full((4, 3), 2.0), "i": torch.arange(5) + 1}).entries)
    assert all(x is y for x, y in zip(again, first, strict=True))  # same layout, same buffer: kept
    moved = dests.views(b, layout)
    assert [v.data_ptr() for v in moved] == [b.data_ptr(), b.data_ptr() + layout[1].offset]
    grown = dests.views(b, encode({"w": torch.ones(4, 3), "i": torch.arange(9)}).entries)
    assert tuple(grown[1].shape) == (9,) and grown[0] is not moved[0]


@pytest.mark.gpu
def test_cuda_state_copied_asynchronously_into_pinned_memory() -> None:
    state = {"w": torch.randn(1 << 20, device="cuda"), "cpu": torch.arange(5)}
    enc = encode(state)
    data = torch.empty(enc.data_len, dtype=torch.uint8).pin_memory()
    stream, dests = torch.cuda.Stream(), Destinations()  # type: ignore[no-untyped-call]
    for step in range(3):  # the second and third copies reuse the first one's views of the buffer
        event = copy_into(enc, data, stream, dests=dests)
        assert event is not None
        event.synchronize()
        out = decode(enc.meta, data, private=False)
        assert torch.equal(out["w"], state["w"].cpu()) and torch.equal(out["cpu"], state["cpu"]), step
        state["w"].add_(1)
