"""State <-> (meta, data) bytes: every dtype and layout, aliasing, the unpickling allow-list."""

from __future__ import annotations

import collections
import dataclasses
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

from ckpt.api import CheckpointCorrupt, CheckpointError, UnsafeSnapshot
from ckpt.codec import (
    _META_HEAD,
    _META_MAGIC,
    Destinations,
    Encoded,
    Stage,
    _tensor_ref,
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
    with pytest.raises(UnsafeSnapshot, match=f"{__name__}:DataPosition"):
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
    with pytest.raises(UnsafeSnapshot, match="not on the allow-list"):
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


def _as_if_on_gpu(enc: Encoded) -> Encoded:
    """The plan's logic does not depend on the device: CPU tensors taken as the GPU ones (all CPU, they are
    laid out in index order, as GPU tensors are) exercise it here; the GPU tests run it on a GPU."""
    return dataclasses.replace(enc, gpu=list(range(len(enc.tensors))), cpu=[])


def _mixed_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    return {
        "small": [torch.randn(int(n), generator=g) for n in torch.randint(1, 40, (25,), generator=g)],
        "steps": [torch.tensor(float(i)) for i in range(5)],
        "half": torch.randn(33, generator=g).half(),
        "mask": torch.rand(50, generator=g) > 0.5,
        "big": torch.randn(600, generator=g),  # 2400 bytes: larger than the stage, copied straight
        "ids": torch.arange(70),
        "t": torch.randn(6, 5, generator=g).t(),  # not contiguous: the slow path of its dtype's group
        "last": torch.randn(3, generator=g),
    }


def test_a_plan_gathers_runs_of_tensors_through_the_stage_and_copies_big_ones_directly() -> None:
    stage = Stage(nbytes=512)
    dests = Destinations(stage)
    state = _mixed_state()
    enc = _as_if_on_gpu(encode(state))
    data = torch.zeros(enc.data_len, dtype=torch.uint8)
    plan = dests.plan(data, enc)
    big = next(i for i, t in enumerate(enc.tensors) if t is state["big"])
    assert big in plan.direct and len(plan.batches) > 2
    covered = sorted([*plan.direct, *(i for b in plan.batches for idx, _ in b.groups for i in idx)])
    assert covered == list(range(len(enc.tensors)))  # every tensor copied, once
    for b in plan.batches:
        assert b.slot.numel() == b.stage.numel() <= 512
        assert len({enc.entries[i].dtype for i in b.groups[0][0]}) == 1  # a group is one dtype
    plan.run_gpu(enc.tensors)
    assert_same(state, decode(enc.meta, data, private=True))


def test_small_cpu_tensors_are_copied_together_and_large_ones_as_raw_bytes() -> None:
    z = torch.randn(8, dtype=torch.complex64)
    state: dict[str, Any] = {
        "steps": [torch.tensor(float(i)) for i in range(20)],
        "conj": z.conj(),
        "large": torch.randn(1024),  # 4 KiB: at the threshold, moved as raw bytes
        "large_t": torch.randn(64, 32).t(),  # large and not contiguous: copy_
    }
    enc = encode(state)
    data = torch.zeros(enc.data_len, dtype=torch.uint8)
    plan = Destinations(small_cpu_bytes=4096).plan(data, enc)
    large = {i for i, t in enumerate(enc.tensors) if t is state["large"] or t is state["large_t"]}
    assert set(plan.large_cpu) == large and len(plan.small_cpu) == len(enc.tensors) - 2
    with ThreadPoolExecutor(2) as pool:
        assert copy_into(enc, data, None, pool, 2, Destinations(small_cpu_bytes=4096)) is None
    out = decode(enc.meta, data, private=True)
    assert torch.equal(out["conj"], z.conj().resolve_conj()) and torch.equal(out["large_t"], state["large_t"])
    assert all(torch.equal(a, b) for a, b in zip(out["steps"], state["steps"], strict=True))
    assert torch.equal(out["large"], state["large"])


def test_a_plan_is_kept_while_buffer_and_layout_stay_and_rebuilt_when_either_changes() -> None:
    dests = Destinations(Stage(nbytes=512))
    a, b = torch.zeros(8192, dtype=torch.uint8), torch.zeros(8192, dtype=torch.uint8)
    first = dests.plan(a, _as_if_on_gpu(encode(_mixed_state())))
    again = _as_if_on_gpu(encode(_mixed_state()))
    assert dests.plan(a, again) is first  # same layout, same buffer: kept
    moved = dests.plan(b, again)
    assert moved is not first and moved.direct_views[0].data_ptr() >= b.data_ptr()
    grown = _mixed_state()
    grown["ids"] = torch.arange(90)
    assert dests.plan(b, _as_if_on_gpu(encode(grown))) is not moved
    moved.run_gpu(again.tensors)
    assert_same(_mixed_state(), decode(again.meta, b, private=True))


def test_without_memory_for_the_stage_every_tensor_is_copied_directly(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_memory(*args: object, **kwargs: object) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    stage = Stage(nbytes=512)
    monkeypatch.setattr(torch, "zeros", no_memory)
    state = _mixed_state()
    enc = _as_if_on_gpu(encode(state))
    data = torch.empty(enc.data_len, dtype=torch.uint8)
    plan = Destinations(stage).plan(data, enc)
    monkeypatch.undo()
    assert stage.refused and not plan.batches and plan.direct == list(range(len(enc.tensors)))
    plan.run_gpu(enc.tensors)
    assert_same(state, decode(enc.meta, data, private=True))


def test_snapshots_of_the_first_metadata_format_still_decode() -> None:
    """Before the tensors were named by ``_tensor_ref`` calls, they were pickle persistent ids
    (``UCKM``): a snapshot taken then, on a peer or in storage, must still restore."""
    state: dict[str, Any] = {"w": torch.arange(6.0).view(2, 3), "same": None, "n": 3}
    state["same"] = state["w"]
    tensors: list[torch.Tensor] = []

    class _FirstFormat(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            if isinstance(obj, torch.Tensor):
                if not any(obj is t for t in tensors):
                    tensors.append(obj)
                return ("t", next(i for i, t in enumerate(tensors) if t is obj))
            return None

    body = io.BytesIO()
    _FirstFormat(body, protocol=pickle.HIGHEST_PROTOCOL).dump(state)
    table = b'[["float32", [2, 3], 0, 24]]'
    meta = _META_HEAD.pack(b"UCKM", len(table)) + table + body.getvalue()
    data = torch.zeros(64, dtype=torch.uint8)
    data[:24] = state["w"].view(-1).view(torch.uint8)
    out = decode(meta, data, private=True)
    assert torch.equal(out["w"], state["w"]) and out["same"] is out["w"] and out["n"] == 3
    assert encode(state).meta[:4] == _META_MAGIC == b"UCK2"


def test_a_forged_tensor_reference_is_corrupt_not_a_crash() -> None:
    class _Forged(pickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            return (_tensor_ref, ("zero",)) if isinstance(obj, torch.Tensor) else NotImplemented

    body = io.BytesIO()
    _Forged(body, protocol=pickle.HIGHEST_PROTOCOL).dump({"w": torch.ones(1)})
    table = b'[["float32", [1], 0, 4]]'
    meta = _META_HEAD.pack(_META_MAGIC, len(table)) + table + body.getvalue()
    with pytest.raises(CheckpointCorrupt, match="not by its index"):
        decode(meta, torch.zeros(64, dtype=torch.uint8), private=True)


def test_a_metadata_table_too_deeply_nested_to_parse_is_corrupt() -> None:
    """A table json.loads cannot parse for its depth raised RecursionError out of decode(); now corrupt."""
    table = b"[" * 100_000
    meta = _META_HEAD.pack(_META_MAGIC, len(table)) + table
    with pytest.raises(CheckpointCorrupt, match="metadata header unreadable"):
        decode(meta, torch.zeros(64, dtype=torch.uint8), private=True)


@pytest.mark.gpu
def test_a_mixed_cuda_state_is_laid_out_gpu_first_and_copied_through_the_stage() -> None:
    """Small CUDA tensors of several dtypes gathered through the stage (several batches), big ones
    copied directly, CPU tensors in between them in the state: the bytes decode to the state."""
    cpu_state = _mixed_state()
    state: dict[str, Any] = {
        "gpu": {
            k: v.cuda() if isinstance(v, torch.Tensor) else [t.cuda() for t in v] for k, v in cpu_state.items()
        },
        "cpu": [torch.arange(3), torch.tensor(2.5)],
        "after": torch.randn(9, device="cuda").conj(),
    }
    enc = encode(state)
    assert all(enc.tensors[i].is_cuda for i in enc.gpu)
    assert enc.cpu and not any(enc.tensors[i].is_cuda for i in enc.cpu)
    last_gpu = max(enc.entries[i].offset for i in enc.gpu)
    assert all(enc.entries[i].offset > last_gpu for i in enc.cpu)  # GPU tensors first: one range of the data
    data = torch.zeros(enc.data_len, dtype=torch.uint8).pin_memory()
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    dests = Destinations(Stage(nbytes=512))
    for _ in range(2):
        event = copy_into(enc, data, stream, dests=dests)
        assert event is not None and len(dests.plan(data, enc).batches) > 2
        event.synchronize()
        out = decode(enc.meta, data, private=False)
        expected = {"gpu": cpu_state, "cpu": state["cpu"], "after": state["after"].resolve_conj().cpu()}
        assert_same(expected, out)
        state["gpu"]["last"].add_(1)
        cpu_state["last"].add_(1)


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
