"""Where each task's GPUs go: counts per task -> GPUs per task per node, moving as few workers as possible.

Moved workers = GPUs a task has in the new placement that it did not have on that node before
(``sum over tasks and nodes of new - min(new, old)``); every other worker keeps its process and state.
Each task's share of a node is a multiple of its tensor-parallel size, so no TP group spans nodes.

How (see docs/decision.md for the argument):

1. *Keep*: start from what each task holds on the usable nodes; a node that shrank below that drops
   blocks (one TP group each), a shrinking task's first; then a task that shrinks drops blocks from
   the nodes where it holds least.
2. *Check*: with the TP sizes forming a divisibility chain (1, 2, 4, 8, ...), placing the new blocks
   largest first always succeeds when it can succeed at all, and that is decided by a closed form per
   block size s: ``sum_n foot_s(K_n) <= capacity - demand(tp >= s)``, where K_n is what the tasks with
   smaller TP keep on node n and ``foot_s(x) = x + (cap_n - x) mod s`` is the room those keeps spoil.
   Keeps of tasks with the largest TP never matter.
3. *Repair*: while the check fails, drop the kept blocks that free an s-slot most cheaply.
4. *Search*: if that lost anything beyond the unavoidable, a depth-first branch and bound over the
   smaller-TP tasks' keeps finds the fewest moves (bounded by ``search_limit`` steps; past it the best
   found so far is used, which is never worse than step 3).
5. *Fill*: place the new blocks largest TP first, preferring nodes the task is already on, then the
   tightest fit.

Deterministic: every choice iterates sorted names.
"""

from __future__ import annotations

from collections.abc import Mapping

from unicron.kernel.errors import PermanentError

Keep = dict[str, dict[str, int]]  # task -> node -> kept GPUs

SEARCH_LIMIT = 5_000


def _validate(counts: Mapping[str, int], nodes: Mapping[str, int], tp: Mapping[str, int]) -> None:
    for node, gpus in nodes.items():
        if gpus < 0:
            raise PermanentError(f"placement: node {node!r} has a negative GPU count {gpus}")
    for task, count in counts.items():
        size = tp.get(task)
        if size is None or size < 1:
            raise PermanentError(f"placement: task {task!r} has no valid tensor-parallel size")
        if count < 0 or count % size:
            raise PermanentError(
                f"placement: task {task!r} asks for {count} GPUs, not a multiple of its tp={size}"
            )
    total = sum(counts.values())
    if total > sum(nodes.values()):
        raise PermanentError(f"placement: {total} GPUs asked for, only {sum(nodes.values())} usable")


class _Problem:
    """The instance, normalised: sorted names, current holdings cut to whole TP groups on usable nodes."""

    def __init__(
        self,
        counts: Mapping[str, int],
        nodes: Mapping[str, int],
        current: Mapping[str, Mapping[str, int]],
        tp: Mapping[str, int],
    ) -> None:
        self.tasks = sorted(t for t, c in counts.items() if c > 0)
        self.nodes = sorted(nodes)
        self.cap = {n: nodes[n] for n in self.nodes}
        self.count = {t: counts[t] for t in self.tasks}
        self.tp = {t: tp[t] for t in self.tasks}
        self.cur: Keep = {}
        # by each task's holdings, not by every node: 100 tasks on 2,048 nodes hold a few thousand pairs
        for t in self.tasks:
            held, size = current.get(t, {}), self.tp[t]
            self.cur[t] = {n: g for n in sorted(held) if n in self.cap and (g := held[n] // size * size) > 0}
        self.sizes = sorted(set(self.tp.values()))
        self.chain = all(b % a == 0 for a, b in zip(self.sizes, self.sizes[1:], strict=False))
        self.total_cap = sum(self.cap.values())
        # demand of blocks of size >= s, per size s
        self.demand_ge = {s: sum(c for t, c in self.count.items() if self.tp[t] >= s) for s in self.sizes}

    def kept(self, keep: Keep) -> int:
        return sum(sum(row.values()) for row in keep.values())

    def upper_bound(self) -> int:
        return sum(min(self.count[t], sum(self.cur[t].values())) for t in self.tasks)

    def foot(self, node: str, x: int, s: int) -> int:
        return x + (self.cap[node] - x) % s

    def load(self, keep: Keep) -> Keep:
        """``keep`` by node: node -> task -> GPUs (tasks in name order), nodes holding nothing left out."""
        out: Keep = {}
        for t in self.tasks:
            for n, g in keep[t].items():
                if g:
                    out.setdefault(n, {})[t] = g
        return out

    def small_in(self, row: Mapping[str, int], s: int) -> int:
        """GPUs kept on a node by tasks whose TP is below ``s``, from its row of :meth:`load`."""
        return sum(g for t, g in row.items() if self.tp[t] < s)

    def violated(self, keep: Keep) -> int | None:
        """The smallest block size whose new blocks cannot all be placed, or None if the keep is feasible."""
        load = self.load(keep)
        for n, row in load.items():
            if sum(row.values()) > self.cap[n]:
                return self.sizes[0]
        if not self.chain:
            return _simulate_fill(self, keep)
        for s in self.sizes:
            # a node holding nothing spoils cap mod s
            spoilt = sum(self.cap[n] % s for n in self.nodes if n not in load)
            spoilt += sum(self.foot(n, self.small_in(row, s), s) for n, row in load.items())
            if spoilt > self.total_cap - self.demand_ge[s]:
                return s
        return None


def _simulate_fill(p: _Problem, keep: Keep) -> int | None:
    try:
        _fill(p, keep)
    except PermanentError as exc:
        return int(exc.args[1]) if len(exc.args) > 1 else p.sizes[0]
    return None


def _drop(keep: Keep, task: str, node: str, size: int) -> None:
    keep[task][node] -= size
    if keep[task][node] == 0:
        del keep[task][node]


def _greedy_keep(p: _Problem) -> Keep:
    keep: Keep = {t: dict(p.cur[t]) for t in p.tasks}
    # A node that shrank below what it holds gives up blocks first, of a task that holds more than its
    # count (free: it lets go of them anyway), then its smallest. Before the shrinks below: a shrink
    # that let go elsewhere first left this node to lose blocks the task then had to place again.
    load = p.load(keep)
    for n in p.nodes:
        row = load.get(n, {})
        while sum(keep[t].get(n, 0) for t in row) > p.cap[n]:
            t = min((t for t in row if keep[t].get(n, 0)),
                    key=lambda t: (sum(keep[t].values()) <= p.count[t], p.tp[t], t))
            _drop(keep, t, n, p.tp[t])
    # a shrinking task lets go where it holds least: those nodes free up soonest
    for t in p.tasks:
        while sum(keep[t].values()) > p.count[t]:
            node = min(keep[t], key=lambda n: (keep[t][n], n))
            _drop(keep, t, node, p.tp[t])
    while (s := p.violated(keep)) is not None:
        if not _repair_step(p, keep, s):
            raise PermanentError(
                f"placement: the asked counts cannot be cut into whole tensor-parallel groups on these nodes "
                f"(blocks of {s} GPUs do not fit)"
            )
    return keep


def _cost_to_free(p: _Problem, x: int, node: str, s: int) -> int | None:
    """GPUs of smaller-TP keeps (``x`` of them on ``node``) to drop before it offers one more s-slot."""
    if x == 0:
        return None
    base = p.foot(node, x, s)
    y = x
    while y > 0 and p.foot(node, y, s) >= base:
        y -= 1
    return x - y


def _repair_step(p: _Problem, keep: Keep, s: int) -> bool:
    """Drop one kept block that brings an s-slot closer at least cost; False if nothing can be dropped."""
    best: tuple[int, str] | None = None
    load = p.load(keep)  # a node holding nothing has nothing to drop
    for n, row in load.items():
        cost = _cost_to_free(p, p.small_in(row, s), n, s)
        if cost is not None and (best is None or (cost, n) < best):
            best = (cost, n)
    if best is not None:
        node = best[1]
        task = min((t for t in load[node] if p.tp[t] < s), key=lambda t: (p.tp[t], t))
        _drop(keep, task, node, p.tp[task])
        return True
    # not a chain (or only same-size keeps left): free the fullest node's smallest block
    held = [(n, t) for n, row in load.items() for t in row]
    if not held:
        return False
    node, task = min(held, key=lambda nt: (p.tp[nt[1]], -sum(load[nt[0]].values()), nt))
    _drop(keep, task, node, p.tp[task])
    return True


class _Search:
    """Branch and bound over the keeps of tasks below the largest TP (the only keeps that matter)."""

    def __init__(self, p: _Problem, incumbent: Keep, limit: int) -> None:
        self.p = p
        self.best = incumbent
        self.best_kept = p.kept(incumbent)
        self.limit = limit
        self.steps = 0
        top = p.sizes[-1]
        self.free_tasks = [t for t in p.tasks if p.tp[t] < top]
        # top-TP tasks keep what the greedy kept: it is as much as they can, and where is irrelevant
        self.fixed: Keep = {t: dict(incumbent[t]) for t in p.tasks if p.tp[t] == top}
        fixed_load = p.load({t: self.fixed.get(t, {}) for t in p.tasks})
        self.fixed_on = {n: sum(fixed_load.get(n, {}).values()) for n in p.nodes}
        self.fixed_kept = p.kept(self.fixed)
        free = set(self.free_tasks)
        cur_load = p.load(p.cur)
        self.pairs = [(n, t) for n in p.nodes for t in cur_load.get(n, {}) if t in free]
        self.node_done_at = {n: i for i, (n, _) in enumerate(self.pairs)}  # index of a node's last pair
        # holdings still undecided from pair i on, per task, for the bound
        self.rest = [{t: 0 for t in self.free_tasks} for _ in range(len(self.pairs) + 1)]
        for i in range(len(self.pairs) - 1, -1, -1):
            n, t = self.pairs[i]
            self.rest[i] = dict(self.rest[i + 1])
            self.rest[i][t] += p.cur[t][n]
        # closed form per size: spoilt room starts at every node keeping nothing, and only grows
        self.room = [p.total_cap - p.demand_ge[s] for s in p.sizes]
        self.base = [sum(p.cap[n] % s for n in p.nodes) for s in p.sizes]

    def run(self) -> Keep:
        keep: Keep = {t: {} for t in self.free_tasks}
        if self.p.chain:
            self._dfs(0, keep, {t: 0 for t in self.free_tasks}, list(self.base))
        return self.best

    def _node_spoils(self, keep: Keep, node: str, spoilt: list[int]) -> list[int] | None:
        """Spoilt room once ``node`` is decided, or None if that already breaks capacity or a closed form."""
        p = self.p
        if sum(keep[t].get(node, 0) for t in self.free_tasks) + self.fixed_on[node] > p.cap[node]:
            return None
        out = []
        for j, s in enumerate(p.sizes):
            x = sum(keep[t].get(node, 0) for t in self.free_tasks if p.tp[t] < s)
            value = spoilt[j] + p.foot(node, x, s) - p.cap[node] % s
            if value > self.room[j]:
                return None
            out.append(value)
        return out

    def _dfs(self, i: int, keep: Keep, kept: dict[str, int], spoilt: list[int]) -> None:
        self.steps += 1
        bound = self.fixed_kept + sum(
            kept[t] + min(self.p.count[t] - kept[t], self.rest[i][t]) for t in self.free_tasks
        )
        if self.steps > self.limit or bound <= self.best_kept:
            return
        if i == len(self.pairs):
            # every node passed its closed-form check, so this keep is feasible
            self.best = {**self.fixed, **{t: dict(keep[t]) for t in self.free_tasks}}
            self.best_kept = self.p.kept(self.best)
            return
        node, task = self.pairs[i]
        size = self.p.tp[task]
        most = min(self.p.cur[task][node], self.p.count[task] - kept[task])
        for amount in range(most, -1, -size):
            if amount:
                keep[task][node] = amount
            else:
                keep[task].pop(node, None)
            kept[task] += amount
            nxt: list[int] | None = spoilt
            if self.node_done_at[node] == i:
                nxt = self._node_spoils(keep, node, spoilt)
            if nxt is not None:
                self._dfs(i + 1, keep, kept, nxt)
            kept[task] -= amount
        keep[task].pop(node, None)


def _fill(p: _Problem, keep: Keep) -> dict[str, dict[str, int]]:
    """Add the new blocks to ``keep``, largest TP first; PermanentError(msg, size) if one does not fit."""
    out: dict[str, dict[str, int]] = {t: dict(keep[t]) for t in p.tasks}
    load = p.load(out)
    free = {n: p.cap[n] - sum(load.get(n, {}).values()) for n in p.nodes}
    for t in sorted(p.tasks, key=lambda t: (-p.tp[t], t)):
        size = p.tp[t]
        for _ in range((p.count[t] - sum(out[t].values())) // size):
            row = out[t]
            node = min((n for n in p.nodes if free[n] >= size), key=lambda n: (-row.get(n, 0), free[n], n),
                       default=None)
            if node is None:
                raise PermanentError(f"placement: no node has {size} free GPUs for task {t!r}", size)
            out[t][node] = out[t].get(node, 0) + size
            free[node] -= size
    return out


def moved_workers(new: Mapping[str, Mapping[str, int]], current: Mapping[str, Mapping[str, int]]) -> int:
    """Workers started somewhere they were not before: ``sum(new - min(new, old))`` over tasks and nodes."""
    moved = 0
    for task, row in new.items():
        old = current.get(task, {})
        moved += sum(g - min(g, old.get(n, 0)) for n, g in row.items())
    return moved


def place(
    counts: Mapping[str, int],
    nodes: Mapping[str, int],
    current: Mapping[str, Mapping[str, int]],
    tp: Mapping[str, int],
    *,
    search_limit: int = SEARCH_LIMIT,
) -> dict[str, dict[str, int]]:
    """Put ``counts`` (task -> GPUs) on ``nodes`` (node -> usable GPUs), moving as few workers as possible.

    ``current`` is task -> node -> GPUs held now (nodes not in ``nodes`` are gone); ``tp`` is each
    task's tensor-parallel size. Returns task -> node -> GPUs (only non-zero entries; tasks with
    count 0 map to ``{}``). Raises :class:`PermanentError` if the counts cannot be placed.
    """
    _validate(counts, nodes, tp)
    p = _Problem(counts, nodes, current, tp)
    result: dict[str, dict[str, int]] = {t: {} for t in counts}
    if not p.tasks:
        return result
    keep = _greedy_keep(p)
    if p.kept(keep) < p.upper_bound() and len(p.sizes) > 1:
        keep = _Search(p, keep, search_limit).run()
    for t, row in _fill(p, keep).items():
        result[t] = {n: g for n, g in sorted(row.items()) if g > 0}
    return result
