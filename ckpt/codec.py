"""Turning a training state into (meta, data) bytes and back, and checksumming them.

``encode`` pickles the state with every tensor replaced by a reference (a call of ``_tensor_ref`` by
its index, through pickle's ``reducer_override``), so any nesting works and a tensor reachable twice is
stored once. The tensors' bytes are then copied, each at a 64-byte aligned offset, into one flat
destination buffer: on CPU a plain ``copy_``, from a GPU asynchronous copies into pinned memory on a
side stream, small tensors gathered through a GPU staging buffer (``Destinations``).

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
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from ckpt.api import Buffer, CheckpointCorrupt, CheckpointError, SnapshotInfo, UnsafeSnapshot
from unicron.kernel import jsontext
from unicron.kernel.errors import InvalidRecord

ALIGN = 64
#: metadata whose pickle names tensors by ``_tensor_ref`` calls; ``_META_MAGIC_V1`` (persistent ids) is
#: still read, so snapshots taken before stay restorable
_META_MAGIC = b"UCK2"
_META_MAGIC_V1 = b"UCKM"
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
    #: indices of the CUDA tensors, laid out first (their bytes are one range of the data), and of the rest
    gpu: list[int] = field(default_factory=list)
    cpu: list[int] = field(default_factory=list)

    @property
    def on_cuda(self) -> bool:
        return bool(self.gpu)


def _is_cuda(t: torch.Tensor, index: int) -> bool:
    if t.layout is torch.strided and not t.is_quantized:
        if t.is_cuda:
            return True
        if t.is_cpu:
            return False
    raise CheckpointError(
        f"tensor #{index} ({t.dtype}, {tuple(t.shape)}, {t.layout}, on {t.device}) cannot be "
        "snapshotted: only dense CPU or CUDA tensors are supported; convert it "
        "(e.g. .to_dense(), .dequantize()) first"
    )


def _tensor_ref(index: int) -> torch.Tensor:
    """The name the metadata pickle calls a tensor by; ``decode``'s unpickler resolves this name to its
    own loader, so this function only has to exist (pickle checks it is importable)."""
    raise CheckpointError(f"tensor #{index}: metadata must be read with ckpt.codec.decode")


class _TableCache:
    """The JSON of the last layout encoded: a training state's layout is the same from one save() to the
    next, and comparing it costs a tenth of encoding it again."""

    def __init__(self) -> None:
        self._last: tuple[list[_Entry], bytes] = ([], b"[]")

    def table(self, entries: list[_Entry]) -> bytes:
        last = self._last  # one read: another thread may replace it meanwhile
        if entries == last[0]:
            return last[1]
        table = json.dumps(entries).encode()  # each entry a JSON array: [dtype, shape, offset, nbytes]
        self._last = (entries, table)
        return table


_TABLES = _TableCache()
_TENSOR_REF = (_tensor_ref.__module__, _tensor_ref.__qualname__)


def encode(state: Any) -> Encoded:
    """Pickle ``state`` with tensors taken out, and lay the tensors out in a flat byte range."""
    tensors: list[torch.Tensor] = []

    class _Pickler(pickle.Pickler):
        # pickle calls this only for objects it has no built-in way for (never for ints, strs, lists,
        # dicts), and never twice for one object (its memo): 606 calls for bench/ckpt.py's state, 4,431 as persistent_id
        def reducer_override(self, obj: Any) -> Any:
            if not isinstance(obj, torch.Tensor):
                return NotImplemented
            tensors.append(obj)
            return _tensor_ref, (len(tensors) - 1,)

    buf = io.BytesIO()
    try:
        _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(state)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"state cannot be snapshotted: {exc}") from exc
    gpu: list[int] = []
    cpu: list[int] = []
    sizes: list[int] = []
    for index, t in enumerate(tensors):  # a few attribute reads per tensor: hundreds of tensors per save()
        (gpu if _is_cuda(t, index) else cpu).append(index)
        sizes.append(t.nbytes)
    offsets = [0] * len(tensors)
    cursor = 0
    for index in gpu + cpu:
        offsets[index] = cursor
        cursor = _align(cursor + sizes[index])
    names = _DTYPE_NAMES
    entries = [_Entry(names[t.dtype], t.shape, o, n) for t, o, n in zip(tensors, offsets, sizes, strict=True)]
    table = _TABLES.table(entries)
    meta = _META_HEAD.pack(_META_MAGIC, len(table)) + table + buf.getvalue()
    return Encoded(meta=meta, tensors=tensors, entries=entries, data_len=cursor, gpu=gpu, cpu=cpu)


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU uint8 tensor, writable, sharing its memory."""
    return memoryview(t.numpy())  # type: ignore[arg-type]  # ndarray implements the buffer protocol


def _dest(data: torch.Tensor, e: _Entry) -> torch.Tensor:
    return data[e.offset : e.offset + e.nbytes].view(_DTYPES[e.dtype]).view(e.shape)


#: GPU bytes through which a snapshot's GPU tensors are gathered: a few multi-tensor kernels copy them
#: into it on the GPU, then one device-to-host copy moves them to the slot; a tensor larger than this is
#: copied straight. One host-issued device-to-host copy per tensor cost ~7 us of host time on an H100
#: machine (3.2 ms for the 447 tensors of bench/ckpt.py's state, 1.3 ms through the stage); the
#: device-to-device copies were not visible in the copies' total time (21.5 against 21.9 ms).
STAGE_BYTES = 64 << 20
#: a CPU tensor smaller than this is copied by one multi-tensor ``copy_`` into kept views of the slot
#: (0.05 ms for 151 optimizer step counters, against 0.3-0.5 ms as one ``memmove`` each); larger ones
#: as raw bytes by the copy threads
SMALL_CPU_BYTES = 1 << 20


class _Batch(NamedTuple):
    """Consecutive GPU tensors of the data, gathered in the stage and moved to the slot in one copy."""

    slot: torch.Tensor  # the slot's bytes the batch covers
    stage: torch.Tensor  # as many bytes at the stage's start
    groups: list[tuple[list[int], list[torch.Tensor]]]  # per dtype: tensor indices, their views of the stage


class _Plan(NamedTuple):
    """How one layout's tensors are copied into one buffer; the GPU copies on the stream that runs them."""

    small_cpu: list[int]  # indices of the CPU tensors copied into their views by one multi-tensor copy_
    small_cpu_views: list[torch.Tensor]
    large_cpu: list[int]  # indices of the CPU tensors moved as raw bytes (or copy_ when not plain)
    direct: list[int]  # indices of the GPU tensors copied straight into their views of the buffer
    direct_views: list[torch.Tensor]
    batches: list[_Batch]

    def run_gpu(self, tensors: list[torch.Tensor]) -> None:
        if self.direct:
            torch._foreach_copy_(self.direct_views, [tensors[i] for i in self.direct], non_blocking=True)
        for batch in self.batches:
            # one stage for all batches: the stream runs each batch's copies after the last one's
            for indices, views in batch.groups:
                torch._foreach_copy_(views, [tensors[i] for i in indices], non_blocking=True)
            batch.slot.copy_(batch.stage, non_blocking=True)


class Stage:
    """The GPU staging buffer shared by a manager's slots (their copies run on one stream, in order).
    Allocated on first use, on the copy stream (its memory is reused only after that stream's work)."""

    def __init__(self, nbytes: int = STAGE_BYTES) -> None:
        self.nbytes = nbytes
        self._buffer: torch.Tensor | None = None
        self.refused = False  # the GPU had no memory for it: tensors are then copied one by one

    def buffer(self, device: torch.device, nbytes: int) -> torch.Tensor | None:
        b = self._buffer
        if b is None or b.device != device or b.numel() < nbytes:
            self._buffer = None  # the old one stays alive while a plan still holds views of it
            try:
                # zeroed: the slot's padding between tensors holds no stray GPU memory
                self._buffer = b = torch.zeros(nbytes, dtype=torch.uint8, device=device)
            except torch.OutOfMemoryError:
                self.refused = True
                return None
        return b


def _batch(data: torch.Tensor, stage: torch.Tensor, run: list[int], span: int, entries: list[_Entry]) -> _Batch:
    start = entries[run[0]].offset
    groups: dict[str, tuple[list[int], list[torch.Tensor]]] = {}
    for i in run:  # one multi-tensor kernel needs one dtype
        e = entries[i]
        indices, views = groups.setdefault(e.dtype, ([], []))
        indices.append(i)
        views.append(_dest(stage, e._replace(offset=e.offset - start)))
    return _Batch(data[start : start + span], stage[:span], list(groups.values()))


class Destinations:
    """How one buffer receives a layout's tensors (``_Plan``), built again only when the buffer, the
    layout or the tensors' device changes: a slot's buffer and a training state's layout stay the same
    from one save() to the next, and building the views is three tensor operations per tensor (for 447
    tensors, 4.9 ms of save()'s 14.6 ms on an H100's host)."""

    def __init__(self, stage: Stage | None = None, small_cpu_bytes: int = SMALL_CPU_BYTES) -> None:
        self._stage = Stage() if stage is None else stage
        self._small_cpu_bytes = small_cpu_bytes
        self._key: tuple[int, int, torch.device | None] = (0, 0, None)
        self._entries: list[_Entry] = []
        self._gpu: list[int] = []
        self._plan: _Plan | None = None

    def plan(self, data: torch.Tensor, enc: Encoded) -> _Plan:
        """The copies of ``enc``'s tensors into ``data``. With GPU tensors, call on the stream that runs them."""
        # the plan's views keep their buffer alive, so its address is not reused while they exist
        key = (data.data_ptr(), data.numel(), enc.tensors[enc.gpu[0]].device if enc.gpu else None)
        if self._plan is None or key != self._key or enc.entries != self._entries or enc.gpu != self._gpu:
            self._plan = self._build(data, enc)
            self._key, self._entries, self._gpu = key, enc.entries, enc.gpu
        return self._plan

    def _build(self, data: torch.Tensor, enc: Encoded) -> _Plan:
        entries = enc.entries
        small = [i for i in enc.cpu if entries[i].nbytes < self._small_cpu_bytes]
        large = [i for i in enc.cpu if entries[i].nbytes >= self._small_cpu_bytes]
        direct, batches = self._gpu_copies(data, enc)
        return _Plan(
            small, [_dest(data, entries[i]) for i in small], large,
            direct, [_dest(data, entries[i]) for i in direct], batches,
        )  # fmt: skip

    def _gpu_copies(self, data: torch.Tensor, enc: Encoded) -> tuple[list[int], list[_Batch]]:
        if not enc.gpu:
            return [], []
        entries = enc.entries
        device = enc.tensors[enc.gpu[0]].device
        if any(enc.tensors[i].device != device for i in enc.gpu):
            return list(enc.gpu), []  # a stage per device is not worth it: straight copies
        runs: list[list[int]] = [[]]
        direct: list[int] = []
        for i in enc.gpu:  # laid out first, in this order: each run is one range of the data
            e, run = entries[i], runs[-1]
            if e.nbytes > self._stage.nbytes:
                direct.append(i)
                runs.append([])
            elif run and e.offset + e.nbytes - entries[run[0]].offset > self._stage.nbytes:
                runs.append([i])
            else:
                run.append(i)
        direct += [r[0] for r in runs if len(r) == 1]  # one tensor gains nothing from the stage
        runs = [r for r in runs if len(r) > 1]
        spans = [entries[r[-1]].offset + entries[r[-1]].nbytes - entries[r[0]].offset for r in runs]
        stage = self._stage.buffer(device, max(spans)) if runs else None
        if stage is None:
            return sorted(direct + [i for r in runs for i in r]), []
        return sorted(direct), [_batch(data, stage, r, span, entries) for r, span in zip(runs, spans, strict=True)]


_PIECE = 16 << 20


def _raw_copyable(t: torch.Tensor) -> bool:
    # bytes in memory are the values: dense, in order, no lazy conjugate/negative view
    return t.is_contiguous() and not t.is_conj() and not t.is_neg()


def _memmove_all(pieces: list[tuple[int, int, int]]) -> None:
    for dst, src, n in pieces:
        ctypes.memmove(dst, src, n)


def _copy_cpu(enc: Encoded, data: torch.Tensor, plan: _Plan, pool: Executor | None, workers: int) -> None:
    """Small CPU tensors: one multi-tensor ``copy_`` into kept views. Larger contiguous ones are moved as
    raw bytes by ``workers`` threads of ``pool`` (memmove releases the GIL), in 16 MiB pieces balanced
    by size: one OpenMP-parallel ``copy_`` per tensor was 5-10x slower than this on a loaded machine,
    hundreds of parallel regions, each waiting for its slowest (descheduled) thread."""
    if plan.small_cpu:
        torch._foreach_copy_(plan.small_cpu_views, [enc.tensors[i] for i in plan.small_cpu])
    base = data.data_ptr()
    groups: list[list[tuple[int, int, int]]] = [[] for _ in range(max(1, workers))]
    loads = [0] * len(groups)
    for index in plan.large_cpu:
        t, e = enc.tensors[index], enc.entries[index]
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

    CPU tensors are copied synchronously (the large ones by ``workers`` threads of ``pool``). CUDA
    tensors are copied asynchronously on ``stream`` (which first waits for the current stream, so the
    values are final); ``data`` must then be pinned, and the caller must hold ``enc.tensors`` until the
    returned CUDA event has completed (no ``record_stream``: the allocator cannot reuse memory of a
    tensor still referenced). Returns that event, or None when everything was copied synchronously.
    ``dests``: the plan of an earlier copy of the same layout into the same buffer, and the stage.
    """
    if data.numel() < enc.data_len or not data.is_contiguous():
        raise CheckpointError(
            f"copy_into: destination of {data.numel()} bytes, need {enc.data_len} contiguous"
        )
    dests = Destinations() if dests is None else dests
    with torch.no_grad():
        if not enc.on_cuda:
            _copy_cpu(enc, data, dests.plan(data, enc), pool, workers)
            return None
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            plan = dests.plan(data, enc)  # on the copy stream: the stage is allocated there
            _copy_cpu(enc, data, plan, pool, workers)
            plan.run_gpu(enc.tensors)
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
        if (module, name) == _TENSOR_REF:
            return self._tensor
        if (module, name) in _SAFE_GLOBALS or (module, name) in self._extra:
            return super().find_class(module, name)
        if module == "torch" and name in _DTYPES:
            return _DTYPES[name]
        raise UnsafeSnapshot(
            f"metadata names {module}.{name}, which is not on the allow-list; if this object is expected in "
            f"the state, add '{module}:{name}' to CheckpointConfig.safe_globals (UNICRON_CKPT_SAFE_GLOBALS)"
        )

    def _tensor(self, index: object) -> torch.Tensor:
        if not isinstance(index, int):
            raise CheckpointCorrupt(f"metadata references a tensor by {index!r}, not by its index")
        return self._load(index)

    def persistent_load(self, pid: Any) -> Any:  # snapshots of the first format (_META_MAGIC_V1)
        if not (isinstance(pid, tuple) and len(pid) == 2 and pid[0] == "t"):
            raise CheckpointCorrupt(f"metadata holds an unknown reference {pid!r}")
        return self._tensor(pid[1])


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
        if magic not in (_META_MAGIC, _META_MAGIC_V1):
            raise ValueError("bad magic")
        raw = jsontext.parse(meta[_META_HEAD.size : _META_HEAD.size + n], "metadata table")
        entries = [_Entry(str(d), tuple(int(x) for x in s), int(o), int(b)) for d, s, o, b in raw]
    except (struct.error, ValueError, TypeError, InvalidRecord) as exc:
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
    except (CheckpointCorrupt, UnsafeSnapshot):
        raise
    except Exception as exc:  # a damaged pickle can raise nearly anything
        raise CheckpointCorrupt(f"metadata unreadable: {type(exc).__name__}: {exc}") from exc
    views = {id(v): v for v in cache.values()}
    with torch.no_grad():
        if into is not None:
            filled = _Filled()
            state = filled.fill(state, into)
            # a view every holder of which got a template needs no copy of its own
            views = {k: v for k, v in views.items() if k not in filled.placed or k in filled.raw}
        if not private:
            for v in views.values():
                c = v.clone()
                v.set_(
                    c.untyped_storage(), 0, c.shape, c.stride()
                )  # detach from the caller's buffer, for every holder of this tensor
    return state


class _Filled:
    """Walks dicts/lists/tuples of a decoded state and a template together, copying matching tensors
    into the template's. A tensor the state holds twice (tied weights) is decoded as one view: each
    holder gets a template (the first one that matched, where its own template does not), so none of
    them is left a view of the data, which the clone pass would no longer detach."""

    def __init__(self) -> None:
        self.placed: dict[int, torch.Tensor] = {}  # id of a view -> the template it was copied into
        self.raw: set[int] = set()  # ids of views returned as they are (to be detached by the caller)

    def fill(self, state: Any, template: Any) -> Any:
        if isinstance(state, torch.Tensor):
            return self._tensor(state, template)
        if isinstance(state, dict) and isinstance(template, dict):
            for k in list(state):
                if k in template:
                    state[k] = self.fill(state[k], template[k])
            return state
        if isinstance(state, list) and isinstance(template, list | tuple) and len(state) == len(template):
            for i, v in enumerate(state):
                state[i] = self.fill(v, template[i])
            return state
        if type(state) is tuple and isinstance(template, list | tuple) and len(state) == len(template):
            return tuple(self.fill(v, t) for v, t in zip(state, template, strict=True))
        return state

    def _tensor(self, state: torch.Tensor, template: Any) -> torch.Tensor:
        key = id(state)  # every tensor of a decoded state is one of decode's views
        match = _is_template_match(template, state)
        first = self.placed.get(key)
        if match and template is not first:
            template.copy_(state)
            self.placed.setdefault(key, template)
            return template  # type: ignore[no-any-return]
        if first is not None:
            return first
        self.raw.add(key)
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
