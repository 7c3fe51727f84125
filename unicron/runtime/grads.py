"""Gradient accumulation and data-parallel reduction with exact, resumable semantics.

Every parameter's ``.grad`` is a view into one flat buffer (:class:`FlatGrads`), so autograd
accumulates into it in place. The vector that is reduced is that buffer plus a short *tail*
(``[loss sum, join flag, stop flag]``) so the flags ride on the gradient collective instead of costing one.

Two modes:

* **sum** (default): each rank sums its micro-batches' gradients; buckets of a *copy* of the sum are
  all-reduced (a failed gloo all-reduce can leave its buffer partly reduced). The result is the sum
  over all B micro-batches whatever the split, equal up to rounding order.
* **deterministic**: each rank keeps *contributions*: left folds of a block's micro-batches starting
  at the block's first one, and single micro-batches otherwise. Buckets of all contributions are
  all-gathered and every rank folds them in the canonical order (micro-batches within a block, then
  blocks) — bit-identical for any data-parallel degree, failure or redistribution.

Buckets are reduced in order and a completed bucket is final: after a failure only the remaining
buckets are reduced again (paper §6 scenario #2: never overwrite reduced gradients).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from unicron.kernel.errors import PermanentError
from unicron.runtime.comm import CPU, CommGroup
from unicron.runtime.plan import BatchLayout

TAIL = 3
"""Extra elements after the gradients: [sum of micro-batch losses, ranks seeing join requests, ranks
asked to stop]; summed with the gradient, so every member learns the flags at the same boundary."""
TAIL_LOSS, TAIL_JOIN, TAIL_STOP = 0, 1, 2


class RuntimeInvariantError(PermanentError):
    """A bookkeeping invariant of the scheduler broke: a bug, never a peer failure (never retried)."""


class FlatGrads:
    """Gradients of ``params`` as views into one buffer of ``numel + TAIL`` elements."""

    def __init__(self, params: Sequence[torch.nn.Parameter], dtype: torch.dtype) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)
        device = self.params[0].device if self.params else None
        self.buf = torch.zeros(self.numel + TAIL, dtype=dtype, device=device)
        self._views: dict[int, list[torch.Tensor]] = {}  # data_ptr of a buffer -> per-parameter views
        self._bound = 0
        self.bind(self.buf)
        self._ptrs = [v.data_ptr() for v in self._views[self.buf.data_ptr()]]

    def bind(self, grads: torch.Tensor) -> None:
        """Point every ``.grad`` at its slice of ``grads`` (``numel`` elements or more): the flat
        buffer for accumulating, the reduced gradient for the optimizer step."""
        key = grads.data_ptr()
        if key == self._bound:
            return
        views = self._views.get(key)
        if views is None:
            views, offset = [], 0
            for p in self.params:
                views.append(grads[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
            if len(self._views) > 4:
                self._views.clear()  # views of buffers no longer in use
            self._views[key] = views
        for p, v in zip(self.params, views, strict=True):
            p.grad = v
        self._bound = key

    @property
    def grads(self) -> torch.Tensor:
        return self.buf[: self.numel]

    def check_views(self) -> None:
        """Autograd must have accumulated in place; if it replaced a ``.grad``, sums would be lost."""
        if self._bound != self.buf.data_ptr():
            raise RuntimeInvariantError("the parameters' .grad are not bound to the flat buffer while accumulating")
        for p, ptr in zip(self.params, self._ptrs, strict=True):
            if p.grad is None or p.grad.data_ptr() != ptr:
                raise RuntimeInvariantError("a parameter's .grad no longer views the flat gradient buffer")


def bucket_bounds(total: int, bucket_elems: int) -> list[tuple[int, int]]:
    """[start, end) of each bucket of the ``total``-element reduce vector. The last bucket holds the
    whole tail: a last bucket shorter than TAIL is merged into the ones before."""
    step = max(1, bucket_elems)
    bounds = [(s, min(total, s + step)) for s in range(0, total, step)]
    while len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] < TAIL:
        bounds[-2:] = [(bounds[-2][0], total)]
    return bounds


# ------------------------------------------------------------------------------------- accumulation


class Accumulator(ABC):
    """What a rank holds of the current iteration's gradient, and which micro-batches it covers."""

    def __init__(self, flat: FlatGrads) -> None:
        self.flat = flat
        self.done: list[int] = []
        #: sum of the kept micro-batches' losses (written into the tail when reducing)
        self.loss_sum = 0.0

    @abstractmethod
    def begin_mb(self) -> None:
        """Prepare the flat buffer for one micro-batch's backward."""

    @abstractmethod
    def end_mb(self, mb: int, loss: float, keep: bool) -> None:
        """Record micro-batch ``mb`` (its gradient now in the flat buffer); ``keep=False`` discards it
        (the replica had to compute it in lockstep but this rank's group already has it)."""

    @abstractmethod
    def reset(self) -> None:
        """Start a new iteration."""


class DirectSum(Accumulator):
    """Autograd accumulates straight into the flat buffer: no per-micro-batch copy. Only safe when a
    backward cannot fail half-way through, i.e. without tensor-parallel collectives."""

    def begin_mb(self) -> None:
        pass

    def end_mb(self, mb: int, loss: float, keep: bool) -> None:
        if not keep:
            raise RuntimeInvariantError("DirectSum cannot discard a micro-batch already accumulated")
        self.loss_sum += loss
        self.done.append(mb)

    def reset(self) -> None:
        self.flat.bind(self.flat.buf)
        self.flat.buf.zero_()
        self.done = []
        self.loss_sum = 0.0

    @property
    def vector(self) -> torch.Tensor:
        return self.flat.buf


class SafeSum(Accumulator):
    """Backward into a zeroed scratch, added to the sum only once the backward completed: a
    tensor-parallel collective failing mid-backward cannot leave half a micro-batch in the sum."""

    def __init__(self, flat: FlatGrads) -> None:
        super().__init__(flat)
        self.sum = torch.zeros_like(flat.buf)

    def begin_mb(self) -> None:
        self.flat.bind(self.flat.buf)
        self.flat.buf.zero_()

    def end_mb(self, mb: int, loss: float, keep: bool) -> None:
        if keep:
            self.sum += self.flat.buf
            self.loss_sum += loss
            self.done.append(mb)

    def reset(self) -> None:
        self.flat.bind(self.flat.buf)
        self.sum.zero_()
        self.done = []
        self.loss_sum = 0.0

    @property
    def vector(self) -> torch.Tensor:
        return self.sum


@dataclass
class Contribution:
    """A left fold of micro-batches ``start .. start+length-1`` (``length > 1`` only from a block start)."""

    start: int
    length: int
    vec: torch.Tensor


class Contributions(Accumulator):
    """Deterministic mode: per-block prefix folds and single micro-batches, never one mixed sum."""

    def __init__(self, flat: FlatGrads, layout: BatchLayout) -> None:
        super().__init__(flat)
        self.layout = layout
        self.items: list[Contribution] = []

    def begin_mb(self) -> None:
        self.flat.bind(self.flat.buf)
        self.flat.buf.zero_()

    def end_mb(self, mb: int, loss: float, keep: bool) -> None:
        if not keep:
            return
        vec = self.flat.buf
        vec[self.flat.numel + TAIL_LOSS] = loss
        block_start = self.layout.block_start(self.layout.block_of(mb))
        run = next((c for c in self.items if c.start == block_start and c.start + c.length == mb), None)
        if run is not None and mb != block_start:
            run.vec += vec  # extends the canonical left fold of this block
            run.length += 1
        else:
            self.items.append(Contribution(mb, 1, vec.clone()))
        self.done.append(mb)

    def reset(self) -> None:
        self.flat.bind(self.flat.buf)
        self.items = []
        self.done = []


# ----------------------------------------------------------------------------------------- reduction

BucketHook = Callable[[int], None] | None
"""Called with a bucket index before that bucket is reduced (fault injection); None when unused."""


class ReduceProgress:
    """The reduced buckets of the current iteration; the first ``done`` are final.

    Each bucket's part holds the *final* gradient: the sum over all micro-batches already multiplied
    by ``scale`` (1/B; the tail elements stay raw sums). The parts live in two full-length buffers: a
    bucket is reduced into the buffer its current part is not in (its *scratch*), and becomes final
    only once the collective succeeded (a failed collective leaves its own buffer half-reduced, never
    a part). After a commit the parts are kept, still holding the previous iteration's gradient, until
    the next iteration's buckets replace them one by one: a peer whose last collective failed while
    ours succeeded can be sent what it missed. When every part sits in one buffer (any iteration that
    completed without a failure), :meth:`final_grads` is that buffer and the optimizer reads it in
    place: no pass over the gradient after the collective.
    """

    def __init__(self, bounds: list[tuple[int, int]], dtype: torch.dtype, numel: int | None = None,
                 scale: float = 1.0, done: int = 0, device: torch.device = CPU) -> None:
        self.bounds = bounds
        self.dtype = dtype
        #: where the buffers live: the gradients' device, which the collectives run on
        self.device = device
        self.total = bounds[-1][1] if bounds else 0
        #: leading elements that are gradients (scaled); the rest is the raw tail
        self.numel = self.total if numel is None else numel
        self.scale = scale
        self.done = done
        #: deterministic mode: every rank's contribution table, gathered once per group
        self.table: list[list[tuple[int, int]]] | None = None
        #: deterministic mode: (joiners waiting, stop requested) summed over the group, gathered with the
        #: table (a rank with no contribution has no vector to carry them in)
        self.flags = (0, 0)
        self._bufs: list[torch.Tensor | None] = [None, None]
        self._side = [-1] * len(bounds)  # per bucket: the buffer holding its part (-1: never reduced)

    def _buffer(self, side: int) -> torch.Tensor:
        buf = self._bufs[side]
        if buf is None:
            buf = self._bufs[side] = torch.zeros(self.total, dtype=self.dtype, device=self.device)
        return buf

    def _grad_elems(self, b: int) -> int:
        """How many of bucket ``b``'s leading elements are gradients (the rest is tail)."""
        s, e = self.bounds[b]
        return max(0, min(e, self.numel) - s)

    def scratch(self, b: int) -> torch.Tensor:
        """Where bucket ``b`` is reduced: the buffer that does not hold its part."""
        s, e = self.bounds[b]
        return self._buffer(1 if self._side[b] == 0 else 0)[s:e]

    def stage(self, b: int, raw: torch.Tensor) -> torch.Tensor:
        """Fill bucket ``b``'s scratch from its raw sums ``raw``: gradients scaled, tail copied (one
        pass, in place of a plain copy); returns the scratch."""
        out = self.scratch(b)
        g = self._grad_elems(b)
        if self.scale == 1.0:
            out.copy_(raw)
        else:
            torch.mul(raw[:g], self.scale, out=out[:g])
            out[g:].copy_(raw[g:])
        return out

    def store(self, b: int, result: torch.Tensor) -> None:
        """Bucket ``b`` (reduced in its scratch) is final."""
        if result.data_ptr() != self.scratch(b).data_ptr():
            raise RuntimeInvariantError(f"bucket {b} was not reduced in its scratch buffer")
        self._side[b] = 1 if self._side[b] == 0 else 0
        self.done = b + 1

    def put(self, b: int, part: torch.Tensor) -> None:
        """Take bucket ``b``'s final part from a peer (already scaled); ``done`` is the caller's."""
        self.scratch(b).copy_(part)
        self._side[b] = 1 if self._side[b] == 0 else 0

    @property
    def complete(self) -> bool:
        return self.done == len(self.bounds)

    def reset(self) -> None:
        self.done = 0
        self.table = None

    def part(self, b: int) -> torch.Tensor:
        side = self._side[b]
        if side < 0:
            raise RuntimeInvariantError(f"bucket {b} was never reduced")
        s, e = self.bounds[b]
        return self._buffer(side)[s:e]

    def tail(self) -> torch.Tensor:
        """The reduced tail elements (the last TAIL elements of the last bucket)."""
        return self.part(len(self.bounds) - 1)[-TAIL:]

    def span(self, lo: int, hi: int) -> torch.Tensor:
        """Buckets [lo, hi) as one tensor (a copy)."""
        return torch.cat([self.part(b) for b in range(lo, hi)])

    def final_grads(self) -> torch.Tensor | None:
        """The whole final gradient as one tensor, when every part sits in the same buffer."""
        sides = set(self._side)
        if len(sides) != 1 or -1 in sides:
            return None
        return self._buffer(sides.pop())[: self.numel]

    def copy_grads_into(self, out: torch.Tensor) -> None:
        """``out[:numel]`` = the final gradient, gathered from the parts (after a mixed recovery)."""
        for b, (s, _) in enumerate(self.bounds):
            g = self._grad_elems(b)
            out[s : s + g].copy_(self.part(b)[:g])


def reduce_sum(group: CommGroup, vector: torch.Tensor, prog: ReduceProgress, hook: BucketHook) -> None:
    """All-reduce the remaining buckets of a scaled copy of ``vector`` over ``group``."""
    for b in range(prog.done, len(prog.bounds)):
        if hook is not None:
            hook(b)
        s, e = prog.bounds[b]
        send = prog.stage(b, vector[s:e])  # a copy: a failed all-reduce can leave its buffer half-reduced
        group.allreduce([send]).wait()
        prog.store(b, send)


def _encode_table(items: Sequence[Contribution], slots: int, device: torch.device,
                  flags: tuple[int, int]) -> torch.Tensor:
    """One row per contribution (start, length; -1 pads), and a last row of the rank's flags."""
    t = torch.full((slots + 1, 2), -1, dtype=torch.int64)
    t[slots, 0], t[slots, 1] = flags
    for i, c in enumerate(items):
        t[i, 0], t[i, 1] = c.start, c.length
    return t.to(device)


def reduce_gather(
    group: CommGroup,
    acc: Contributions,
    prog: ReduceProgress,
    hook: BucketHook,
    flags: tuple[int, int],
) -> None:
    """Deterministic reduction: all-gather the contributions bucket by bucket and fold them in the
    canonical order. A completed bucket holds the final sum and is never recomputed. ``flags`` (this
    rank's join and stop) are summed into the tail of the last bucket, as the sum mode's all-reduce does."""
    layout = acc.layout
    size = group.size()
    if prog.table is None:
        mine = _encode_table(acc.items, layout.micro_batches, prog.device, flags)
        tables = [torch.empty_like(mine) for _ in range(size)]
        group.allgather([tables], [mine]).wait()
        prog.flags = (sum(int(t[-1, 0]) for t in tables), sum(int(t[-1, 1]) for t in tables))
        prog.table = [[(int(a), int(b)) for a, b in t[:-1].tolist() if a >= 0] for t in tables]
    blocks = canonical_order(prog.table, layout)
    slots = max(len(t) for t in prog.table)
    for b in range(prog.done, len(prog.bounds)):
        if hook is not None:
            hook(b)
        s, e = prog.bounds[b]
        local = torch.zeros((slots, e - s), dtype=prog.dtype, device=prog.device)
        for i, c in enumerate(acc.items):
            local[i] = c.vec[s:e]
        out = [torch.empty_like(local) for _ in range(size)]
        group.allgather([out], [local]).wait()
        total = fold([[out[r][i] for r, i in blk] for blk in blocks])
        if b == len(prog.bounds) - 1:
            total[-TAIL + TAIL_JOIN], total[-TAIL + TAIL_STOP] = prog.flags
        prog.store(b, prog.stage(b, total))


def canonical_order(table: Sequence[Sequence[tuple[int, int]]], layout: BatchLayout) -> list[list[tuple[int, int]]]:
    """For each block, the (rank, slot) of its contributions in micro-batch order. Checks that every
    micro-batch is covered exactly once and that only a block's first contribution is a fold."""
    by_start: dict[int, tuple[int, int, int]] = {}
    for r, items in enumerate(table):
        for i, (start, length) in enumerate(items):
            if start in by_start:
                raise RuntimeInvariantError(f"micro-batch {start} contributed twice")
            by_start[start] = (r, i, length)
    blocks: list[list[tuple[int, int]]] = []
    for block in range(layout.blocks):
        first = layout.block_start(block)
        pos, end, parts = first, first + layout.block_size, []
        while pos < end:
            if pos not in by_start:
                raise RuntimeInvariantError(f"micro-batch {pos} is missing from the reduction")
            r, i, length = by_start.pop(pos)
            if length > 1 and pos != first:
                raise RuntimeInvariantError(f"a fold of {length} starts mid-block at micro-batch {pos}")
            parts.append((r, i))
            pos += length
        if pos != end:
            raise RuntimeInvariantError(f"block {block} is over-covered")
        blocks.append(parts)
    if by_start:
        raise RuntimeInvariantError(f"contributions start inside other folds: {sorted(by_start)}")
    return blocks


def fold(blocks: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
    """The canonical sum: each block's parts left to right, then the block sums left to right."""
    total: torch.Tensor | None = None
    for parts in blocks:
        partial = parts[0].clone()
        for p in parts[1:]:
            partial += p
        if total is None:
            total = partial
        else:
            total += partial
    if total is None:
        raise RuntimeInvariantError("nothing to fold")
    return total
