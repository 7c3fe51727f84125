"""Turning a training state into (meta, data) bytes and back, and checksumming them.

``encode`` pickles the state with every tensor replaced by a reference (pickle's ``persistent_id``),
so any nesting works and a tensor reachable twice is stored once. The tensors' bytes are then copied,
each at a 64-byte aligned offset, into one flat destination buffer: on CPU a plain ``copy_``, from a
GPU an asynchronous copy into pinned memory on a side stream.

``decode`` unpickles with an allow-list (metadata may come from a peer or remote storage, and
unrestricted unpickling would let a forged file run code) and turns references back into tensors.
"""

from __future__ import annotations

import ctypes
import io
import json
import pickle
import struct
import zlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ckpt.api import Buffer, CheckpointCorrupt, CheckpointError, SnapshotInfo

ALIGN = 64
_META_MAGIC = b"UCKM"
_META_HEAD = struct.Struct("!4sI")
_DTYPES: dict[str, torch.dtype] = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)
}
_DTYPE_NAMES: dict[torch.dtype, str] = {v: str(v).removeprefix("torch.") for v in _DTYPES.values()}

# Globals the metadata pickle may name: containers, numbers and the classes optimizer/scheduler/RNG
# states use. Everything else must be listed in CheckpointConfig.safe_globals.
_SAFE_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    [
        ("builtins", n)
        for n in (
            "set",
            "frozenset",
            "slice",
            "range",
            "complex",
            "bytearray",
            "list",
            "dict",
            "tuple",
            "int",
            "float",
            "str",
            "bytes",
            "bool",
        )
    ]
    + [("collections", n) for n in ("OrderedDict", "defaultdict", "deque", "Counter")]
    + [("torch", "Size"), ("torch", "device")]
    + [
        (m, n)
        for m in ("numpy._core.multiarray", "numpy.core.multiarray")
        for n in ("_reconstruct", "scalar")
    ]
    + [(m, "_frombuffer") for m in ("numpy._core.numeric", "numpy.core.numeric")]
    + [("numpy", "ndarray"), ("numpy", "dtype")]
    + [
        ("argparse", "Namespace"),
        ("types", "SimpleNamespace"),
        ("datetime", "datetime"),
        ("datetime", "date"),
        ("datetime", "timedelta"),
        ("decimal", "Decimal"),
        ("fractions", "Fraction"),
    ]
)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class _Entry(NamedTuple):
    """Where one tensor lies in the data. A tuple, not a dataclass: ``encode`` makes hundreds per save(),
    and the table is these tuples as JSON arrays."""

    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass
class Encoded:
    """A state split into its metadata bytes and the tensors still to be copied."""

    meta: bytes
    tensors: list[torch.Tensor]
    entries: list[_Entry]
    data_len: int

    @property
    def on_cuda(self) -> bool:
        return any(t.is_cuda for t in self.tensors)


def _check_tensor(t: torch.Tensor, index: int) -> None:
    if t.layout != torch.strided or t.is_quantized or not (t.is_cpu or t.is_cuda):
        raise CheckpointError(
            f"tensor #{index} ({t.dtype}, {tuple(t.shape)}, {t.layout}, on {t.device}) cannot be "
            "snapshotted: only dense CPU or CUDA tensors are supported; convert it "
            "(e.g. .to_dense(), .dequantize()) first"
        )


def encode(state: Any) -> Encoded:
    """Pickle ``state`` with tensors taken out, and lay the tensors out in a flat byte range."""
    tensors: list[torch.Tensor] = []
    seen: dict[int, int] = {}

    class _Pickler(pickle.Pickler):
        # called for every object pickled: tensors are only collected here, laid out below
        def persistent_id(self, obj: Any) -> Any:
            if not isinstance(obj, torch.Tensor):
                return None
            index = seen.get(id(obj))
            if index is None:
                index = seen[id(obj)] = len(tensors)
                tensors.append(obj)
            return ("t", index)

    buf = io.BytesIO()
    try:
        _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(state)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"state cannot be snapshotted: {exc}") from exc
    entries: list[_Entry] = []
    cursor = 0
    for index, t in enumerate(tensors):
        _check_tensor(t, index)
        entries.append(_Entry(_DTYPE_NAMES[t.dtype], tuple(t.shape), cursor, t.nbytes))
        cursor = _align(cursor + t.nbytes)
    table = json.dumps(entries).encode()  # each entry a JSON array: [dtype, shape, offset, nbytes]
    meta = _META_HEAD.pack(_META_MAGIC, len(table)) + table + buf.getvalue()
    return Encoded(meta=meta, tensors=tensors, entries=entries, data_len=cursor)


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU uint8 tensor, writable, sharing its memory."""
    return memoryview(t.numpy())  # type: ignore[arg-type]  # ndarray implements the buffer protocol


def _dest(data: torch.Tensor, e: _Entry) -> torch.Tensor:
    return data[e.offset : e.offset + e.nbytes].view(_DTYPES[e.dtype]).view(e.shape)


class Destinations:
    """The views of one buffer that a layout's tensors are copied into, built again only when the
    buffer or the layout changes. Building them is three tensor operations per tensor: for a GPU state
    of 447 tensors, 4.9 ms of save()'s 14.6 ms on an H100's host. A slot's buffer and a training
    state's layout stay the same from one save() to the next."""

    def __init__(self) -> None:
        self._key: tuple[int, int] = (0, 0)
        self._entries: list[_Entry] = []
        self._views: list[torch.Tensor] = []

    def views(self, data: torch.Tensor, entries: list[_Entry]) -> list[torch.Tensor]:
        # the cached views keep their buffer alive, so its address is not reused while they exist
        key = (data.data_ptr(), data.numel())
        if key != self._key or entries != self._entries:
            self._views = [_dest(data, e) for e in entries]
            self._key, self._entries = key, entries
        return self._views


_PIECE = 16 << 20


def _raw_copyable(t: torch.Tensor) -> bool:
    # bytes in memory are the values: dense, in order, no lazy conjugate/negative view
    return t.device.type == "cpu" and t.is_contiguous() and not t.is_conj() and not t.is_neg()


def _memmove_all(pieces: list[tuple[int, int, int]]) -> None:
    for dst, src, n in pieces:
        ctypes.memmove(dst, src, n)


def _copy_cpu(enc: Encoded, data: torch.Tensor, pool: Executor | None, workers: int) -> None:
    """Contiguous CPU tensors are moved as raw bytes by ``workers`` threads of ``pool`` (memmove
    releases the GIL), in 16 MiB pieces balanced by size. One OpenMP-parallel ``copy_`` per tensor
    was 5-10x slower than this on a loaded machine: hundreds of parallel regions, each waiting for
    its slowest (descheduled) thread. Other tensors go through ``copy_``."""
    base = data.data_ptr()
    groups: list[list[tuple[int, int, int]]] = [[] for _ in range(max(1, workers))]
    loads = [0] * len(groups)
    for t, e in zip(enc.tensors, enc.entries, strict=True):
        if t.is_cuda:
            continue
        if not _raw_copyable(t):
            _dest(data, e).copy_(t)
            continue
        src = t.data_ptr()
        for off in range(0, e.nbytes, _PIECE):
            i = loads.index(min(loads))
            n = min(_PIECE, e.nbytes - off)
            groups[i].append((base + e.offset + off, src + off, n))
            loads[i] += n
    if pool is None or len(groups) == 1:
        for g in groups:
            _memmove_all(g)
    else:
        for _ in pool.map(_memmove_all, groups):
            pass


def copy_into(
    enc: Encoded,
    data: torch.Tensor,
    stream: Any = None,
    pool: Executor | None = None,
    workers: int = 1,
    dests: Destinations | None = None,
) -> Any:
    """Copy the tensors into ``data`` (uint8, at least ``enc.data_len`` long).

    CPU tensors are copied synchronously (by ``workers`` threads of ``pool``). CUDA tensors are copied
    asynchronously on ``stream`` (which first waits for the current stream, so the values are final);
    ``data`` must then be pinned, and the caller must hold ``enc.tensors`` until the returned CUDA event
    has completed (no ``record_stream``: the allocator cannot reuse memory of a tensor still referenced).
    Returns that event, or None when everything was copied synchronously. ``dests``: the views of
    ``data`` kept from an earlier copy of CUDA tensors into the same buffer.
    """
    if data.numel() < enc.data_len or not data.is_contiguous():
        raise CheckpointError(
            f"copy_into: destination of {data.numel()} bytes, need {enc.data_len} contiguous"
        )
    with torch.no_grad():
        _copy_cpu(enc, data, pool, workers)
        if not enc.on_cuda:
            return None
        views = (Destinations() if dests is None else dests).views(data, enc.entries)
        on_gpu = [i for i, t in enumerate(enc.tensors) if t.is_cuda]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            # one call for all: a copy_ per tensor costs the host more than the whole list's launch
            torch._foreach_copy_([views[i] for i in on_gpu], [enc.tensors[i] for i in on_gpu], non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
        return event


class _Unpickler(pickle.Unpickler):
    def __init__(
        self, data: bytes, load: Callable[[int], torch.Tensor], extra: frozenset[tuple[str, str]]
    ) -> None:
        super().__init__(io.BytesIO(data))
        self._load = load
        self._extra = extra

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE_GLOBALS or (module, name) in self._extra:
            return super().find_class(module, name)
        if module == "torch" and name in _DTYPES:
            return _DTYPES[name]
        raise CheckpointCorrupt(
            f"metadata names {module}.{name}, which is not on the allow-list; if this object is expected in "
            f"the state, add '{module}:{name}' to CheckpointConfig.safe_globals (UNICRON_CKPT_SAFE_GLOBALS)"
        )

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 2 and pid[0] == "t" and isinstance(pid[1], int)):
            raise CheckpointCorrupt(f"metadata holds an unknown reference {pid!r}")
        return self._load(pid[1])


def parse_safe_globals(spec: Sequence[str]) -> frozenset[tuple[str, str]]:
    """``["pkg.mod:Name", ...]`` -> {(module, name)}."""
    out = set()
    for item in spec:
        module, sep, name = item.partition(":")
        if not sep or not module or not name:
            raise CheckpointError(f"safe_globals: {item!r} is not 'module:Name'")
        out.add((module, name))
    return frozenset(out)


def _read_table(meta: bytes) -> tuple[list[_Entry], bytes]:
    try:
        magic, n = _META_HEAD.unpack_from(meta)
        if magic != _META_MAGIC:
            raise ValueError("bad magic")
        raw = json.loads(meta[_META_HEAD.size : _META_HEAD.size + n])
        entries = [_Entry(str(d), tuple(int(x) for x in s), int(o), int(b)) for d, s, o, b in raw]
    except (struct.error, ValueError, TypeError) as exc:
        raise CheckpointCorrupt(f"metadata header unreadable: {exc}") from exc
    for e in entries:
        if e.dtype not in _DTYPES:
            raise CheckpointCorrupt(f"metadata names unknown dtype {e.dtype!r}")
    return entries, meta[_META_HEAD.size + n :]


def _is_template_match(t: Any, src: torch.Tensor) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == src.dtype and t.shape == src.shape


def decode(
    meta: bytes,
    data: torch.Tensor,
    *,
    private: bool,
    into: Any = None,
    safe_globals: frozenset[tuple[str, str]] = frozenset(),
) -> Any:
    """Rebuild the state from verified ``meta`` and ``data`` (a uint8 tensor).

    ``private``: ``data`` belongs to the caller and may back the returned tensors (they become views of
    it); otherwise every tensor is copied out. ``into``: a state of the same structure whose tensors
    receive the values in place (``copy_``, any device) when path, dtype and shape match; the returned
    state then holds those very tensors.
    """
    entries, body = _read_table(meta)
    for i, e in enumerate(entries):
        if e.offset + e.nbytes > data.numel():
            raise CheckpointCorrupt(
                f"tensor #{i} lies outside the data ({e.offset}+{e.nbytes} > {data.numel()})"
            )
    cache: dict[int, torch.Tensor] = {}

    def load(i: int) -> torch.Tensor:
        if not 0 <= i < len(entries):
            raise CheckpointCorrupt(f"metadata references tensor #{i} of {len(entries)}")
        if i not in cache:
            cache[i] = _dest(data, entries[i])
        return cache[i]

    try:
        state = _Unpickler(body, load, safe_globals).load()
    except CheckpointCorrupt:
        raise
    except Exception as exc:  # a damaged pickle can raise nearly anything
        raise CheckpointCorrupt(f"metadata unreadable: {type(exc).__name__}: {exc}") from exc
    views = {id(v): v for v in cache.values()}
    with torch.no_grad():
        if into is not None:
            state = _fill_template(state, into, views)
        if not private:
            for v in views.values():
                c = v.clone()
                v.set_(
                    c.untyped_storage(), 0, c.shape, c.stride()
                )  # detach from the caller's buffer, for every holder of this tensor
    return state


def _fill_template(state: Any, template: Any, views: dict[int, torch.Tensor]) -> Any:
    """Walk dicts/lists/tuples of ``state`` and ``template`` together; copy matching tensors into place."""
    if isinstance(state, torch.Tensor):
        if id(state) in views and _is_template_match(template, state):
            template.copy_(state)
            views.pop(id(state))
            return template
        return state
    if isinstance(state, dict) and isinstance(template, dict):
        for k in list(state):
            if k in template:
                state[k] = _fill_template(state[k], template[k], views)
        return state
    if isinstance(state, list) and isinstance(template, list | tuple) and len(state) == len(template):
        for i, v in enumerate(state):
            state[i] = _fill_template(v, template[i], views)
        return state
    if type(state) is tuple and isinstance(template, list | tuple) and len(state) == len(template):
        return tuple(_fill_template(v, t, views) for v, t in zip(state, template, strict=True))
    return state


# --------------------------------------------------------------------------------------------- checksums


def crc(data: Buffer) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


def chunk_crcs(data: memoryview, chunk_bytes: int, pool: Executor | None = None) -> tuple[int, ...]:
    """CRC-32 of each chunk; with a pool the chunks are summed in parallel (zlib releases the GIL)."""
    pieces = [data[o : o + chunk_bytes] for o in range(0, len(data), chunk_bytes)]
    if pool is None or len(pieces) < 2:
        return tuple(crc(p) for p in pieces)
    return tuple(pool.map(crc, pieces))


def verify(snap_info: SnapshotInfo, meta: Buffer, data: memoryview, pool: Executor | None = None) -> None:
    """Raise CheckpointCorrupt unless ``meta``/``data`` are exactly the bytes ``snap_info`` describes."""
    if len(meta) != snap_info.meta_len:
        raise CheckpointCorrupt(f"partial: metadata has {len(meta)} bytes, expected {snap_info.meta_len}")
    if len(data) != snap_info.data_len:
        raise CheckpointCorrupt(f"partial: data has {len(data)} bytes, expected {snap_info.data_len}")
    if crc(meta) != snap_info.meta_crc:
        raise CheckpointCorrupt("checksum mismatch in the metadata")
    got = chunk_crcs(data, snap_info.chunk_bytes, pool)
    for i, (a, b) in enumerate(zip(got, snap_info.chunk_crcs, strict=True)):
        if a != b:
            o = i * snap_info.chunk_bytes
            raise CheckpointCorrupt(
                f"checksum mismatch in chunk {i} (bytes {o}..{o + snap_info.chunk_bytes})"
            )


def nonfinite_tensors(state: Any) -> Iterator[str]:
    """Describe floating tensors holding NaN/Inf (walks dicts, lists and tuples)."""
    stack: list[tuple[str, Any]] = [("", state)]
    while stack:
        path, obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            if (obj.is_floating_point() or obj.is_complex()) and not bool(torch.isfinite(obj).all()):
                yield path or "<root>"
        elif isinstance(obj, dict):
            stack.extend((f"{path}/{k}", v) for k, v in obj.items())
        elif isinstance(obj, list | tuple):
            stack.extend((f"{path}/{i}", v) for i, v in enumerate(obj))
