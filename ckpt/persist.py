"""The remote tier: snapshots persisted to a :class:`ckpt.api.Storage`, with manifests and retention.

Layout under ``<job>/rank-<rank>/``::

    iter-<iteration>/<write>/shard-<i>.bin    chunk i of the tensor bytes (the checksummed chunks of SnapshotInfo)
    iter-<iteration>/<write>/meta.bin         the metadata bytes (<write>: g<generation>-<a random id>)
    manifest-<iteration>-g<generation>.json   {"format", "crc32", "body": {"info", "meta", "shards": [...]}}

and, per job, ``<job>/persisted/rank-<rank>-<iteration>`` (empty): one marker per published manifest,
written after it and deleted before it, so that one listing tells every rank's persisted iterations.
Retention reads them: a rank never deletes an iteration the other ranks may still need to restore with.

Shards and metadata are written (durably) first, the manifest last: an iteration exists only once its
manifest does, so a writer killed mid-way leaves the previous manifest the newest valid one. Each
manifest carries a CRC of its own body and the CRC of every shard; a reader checks them all. A write
that fails removes what it wrote and sweeps dead writers' orphans (best-effort): on a full filesystem
their bytes made every later persist fail.

Generations: a writer refuses (StaleGeneration) when storage holds any manifest of the rank written by
a newer task generation, checked before the upload, again before the manifest is written and once more
after it (then it deletes its own). The generation is in the manifest's name, so two generations
writing one iteration never replace each other's manifest: a reader takes the newest generation's
(the name without one, of the first layout, counts as the oldest). Retention of an older generation
leaves a newer one's writes alone.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any

import torch

from ckpt.api import (
    CheckpointCorrupt,
    ObjectMissing,
    Snapshot,
    SnapshotInfo,
    StaleGeneration,
    Storage,
    StorageFull,
)
from ckpt.codec import byte_view, crc
from unicron.kernel import jsontext, log
from unicron.kernel.errors import InvalidRecord, UnicronError

_log = log.get("ckpt.persist")

_MANIFEST_RX = re.compile(r"manifest-(\d{12})(?:-g(\d{12}))?\.json$")
#: a write's directory (generation: none in the first layouts), or a file of the layout without one
_WRITE_RX = re.compile(r"iter-(\d{12})/(?:(?:g(\d{12})-)?[0-9a-f]+/|[^/]+$)")
_MARKER_RX = re.compile(r"/persisted/rank-(\d{5})-(\d{12})$")


def rank_prefix(job: str, rank: int) -> str:
    return f"{job}/rank-{rank:05d}/"


def manifest_key(job: str, rank: int, iteration: int, generation: int = 0) -> str:
    return f"{rank_prefix(job, rank)}manifest-{iteration:012d}-g{generation:012d}.json"


def _manifests(storage: Storage, job: str, rank: int, start: str = "manifest-") -> dict[int, list[tuple[int, str]]]:
    """Iteration -> (generation by its name, key) of each of its manifests, newest generation first
    (-1: a name of the first layout, without one). ``start``: of the keys whose name starts so."""
    out: dict[int, list[tuple[int, str]]] = {}
    for key in storage.list(f"{rank_prefix(job, rank)}{start}"):
        m = _MANIFEST_RX.search(key)
        if m:
            out.setdefault(int(m.group(1)), []).append((-1 if m.group(2) is None else int(m.group(2)), key))
    return {it: sorted(v, reverse=True) for it, v in out.items()}


def marker_key(job: str, rank: int, iteration: int) -> str:
    return f"{job}/persisted/rank-{rank:05d}-{iteration:012d}"


def _iter_prefix(job: str, rank: int, iteration: int) -> str:
    return f"{rank_prefix(job, rank)}iter-{iteration:012d}/"


def _canonical(body: Any) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def persist(
    storage: Storage, snap: Snapshot, keep: int, world_size: int = 0, step: Callable[[], None] | None = None,
    progress: Callable[[], None] | None = None, committed: Callable[[], None] | None = None,
) -> str:
    """Write ``snap`` (shards, metadata, the manifest, then its marker); then apply retention (see
    :func:`apply_retention`, which ``world_size`` is passed to). ``step``: called before each write of
    the upload (the last one before the manifest: the data is all written by then); what it raises
    ends the write as a failed one (its shards removed, no manifest), e.g. a writer whose snapshot's
    memory was taken back while the storage hung. ``progress``: passed to the storage's writes of the
    data (:meth:`Storage.write`). ``committed``: called once the manifest and its marker are written
    (the snapshot is persisted; retention follows).

    A write that finds the storage full (:class:`StorageFull`) deletes the rank's persisted snapshots
    that only the lag window kept (:func:`make_room`) and is tried once more: retention runs only after
    a successful write, so a filesystem filled by the job's own retained snapshots stopped persistence
    for good."""
    try:
        return _persist_once(storage, snap, keep, world_size, step, progress, committed)
    except StorageFull as exc:
        gone = make_room(storage, snap.info, keep, world_size)
        if not gone:
            raise
        _log.warning("storage full: deleted older persisted snapshots kept for lagging ranks; writing again",
                     job=snap.info.job, rank=snap.info.rank, iteration=snap.info.iteration, deleted=gone,
                     error=str(exc))
        return _persist_once(storage, snap, keep, world_size, step, progress, committed)


def make_room(storage: Storage, info: SnapshotInfo, keep: int, world_size: int = 0) -> list[int]:
    """Retention without the lag window, for a write of ``info`` that found the storage full: of the
    rank's persisted iterations, keep the newest ``keep`` and the newest every rank has persisted (the
    last complete checkpoint); delete the others. Nothing once a newer generation wrote one (its writes
    are not ours to delete). Returns the deleted iterations (best-effort: none when the storage fails)."""
    gone: list[int] = []
    try:
        manifests = _manifests(storage, info.job, info.rank)
        if any(g > info.generation for v in manifests.values() for g, _ in v):
            return []
        its = sorted(manifests)
        spare = set(its[-keep:])
        needed = _needed_line(storage, info.job, world_size)
        if needed is not None and needed[1] is not None:
            spare.add(needed[1])
        for it in its:
            if it not in spare:
                _delete_iteration(storage, info.job, info.rank, it, info.generation)
                gone.append(it)
    except UnicronError as exc:
        _log.warning("could not make room in a full storage", job=info.job, rank=info.rank, error=str(exc))
    return gone


def _persist_once(
    storage: Storage, snap: Snapshot, keep: int, world_size: int, step: Callable[[], None] | None,
    progress: Callable[[], None] | None, committed: Callable[[], None] | None,
) -> str:
    info = snap.info
    check = step if step is not None else (lambda: None)
    held = _manifests(storage, info.job, info.rank)  # listed once for both (a remote listing is I/O)
    _check_generation(storage, info, held)
    discard_newer(storage, info.job, info.rank, info.iteration, sorted(held), info.generation)  # linear timeline
    # a directory of this write's own: two writers of one iteration (a stopping incarnation still
    # persisting it, and its relaunch that restored an older one and reached it again) replaced each
    # other's shards, and the manifest left named bytes the other wrote (both were told "persisted")
    base = f"{_iter_prefix(info.job, info.rank, info.iteration)}g{info.generation:012d}-{uuid.uuid4().hex[:12]}/"
    key = manifest_key(info.job, info.rank, info.iteration, info.generation)
    written = False  # whether the manifest may be this write's
    try:
        shards = []
        for i, (off, n) in enumerate(info.chunks()):
            shard = f"{base}shard-{i:05d}.bin"
            check()
            storage.write(shard, snap.data[off : off + n], progress=progress)
            shards.append({"key": shard, "offset": off, "length": n, "crc32": info.chunk_crcs[i]})
        check()
        storage.write(f"{base}meta.bin", snap.meta, progress=progress)
        body = {
            "info": info.to_dict(),
            "meta": {"key": f"{base}meta.bin", "length": info.meta_len, "crc32": info.meta_crc},
            "shards": shards,
        }
        # a newer generation may have persisted during the upload (a stop snapshot of gigabytes takes minutes)
        _check_generation(storage, info, _manifests(storage, info.job, info.rank))
        check()  # the shards came from memory that is the writer's until now: no manifest names torn bytes
        written = True
        storage.write(key, _canonical({"format": 1, "crc32": crc(_canonical(body)), "body": body}))
        storage.write(marker_key(info.job, info.rank, info.iteration), b"")
        # ... or between that check and the write: readers take the newest generation's manifest, but ours
        # would be the newest of its iteration for a reader, and an older generation's retention could follow
        held = _manifests(storage, info.job, info.rank)
        _check_generation(storage, info, held)
    except BaseException:
        # a write that failed (a full filesystem) left its shards behind, and nothing collected them
        # until a persist succeeded: they kept the filesystem full and persistence stopped for good
        _withdraw(storage, info, base, key if written else None)
        _sweep_after_failure(storage, info)
        raise
    for _, other in held.get(info.iteration, [])[1:]:  # an older generation's of this iteration: superseded
        storage.delete(other)
    for it in list(held):  # what is left of the listing just read (retention needs no other)
        held[it] = held[it][:1]
    if committed is not None:
        committed()
    apply_retention(storage, info.job, info.rank, keep, world_size, info.generation, held)
    return key


def _delete_prefix(storage: Storage, prefix: str) -> None:
    for k in storage.list(prefix):
        storage.delete(k)


def _withdraw(storage: Storage, info: SnapshotInfo, base: str, manifest: str | None) -> None:
    """Remove what a failed write left, best-effort (the storage may be what failed): the ``manifest``
    key if it holds this write's (None: not written; another writer of the iteration and generation may
    hold the key), with the marker when no other manifest of the iteration is left, then the shards
    (never before a manifest naming them)."""
    try:
        if manifest is not None and _names(storage, manifest, base):
            if [k for _, k in _manifests(storage, info.job, info.rank).get(info.iteration, [])] == [manifest]:
                storage.delete(marker_key(info.job, info.rank, info.iteration))  # "some manifest of it exists"
            storage.delete(manifest)
        _delete_prefix(storage, base)
    except Exception as exc:  # the write's own error is the one to report
        _log.warning("could not remove a failed write", write=base, error=str(exc))


def _names(storage: Storage, manifest: str, base: str) -> bool:
    """Whether the manifest ``manifest`` names the shards of the write ``base`` (a random id: unambiguous)."""
    try:
        return base.encode() in storage.read(manifest)
    except ObjectMissing:
        return False


def _sweep_after_failure(storage: Storage, info: SnapshotInfo) -> None:
    """Remove dead writers' orphaned writes now (best-effort), not only after the next successful
    persist: on a full filesystem their bytes are what makes every persist fail."""
    try:
        held = _manifests(storage, info.job, info.rank)
        if held and not any(g > info.generation for v in held.values() for g, _ in v):
            _sweep_orphans(storage, info.job, info.rank, info.generation, held, set(held))
    except Exception as exc:
        _log.warning("could not sweep orphaned writes", job=info.job, rank=info.rank, error=str(exc))


def _check_generation(storage: Storage, info: SnapshotInfo, persisted: dict[int, list[tuple[int, str]]]) -> None:
    """StaleGeneration when storage holds a snapshot of the rank written by a newer task generation, at
    any iteration: that generation restored an older state and trained on, so this one (the late
    snapshot of a stopping generation) is of an abandoned timeline; persisted, it replaced its relaunch's
    or, dropping newer iterations as abandoned and older ones by retention, deleted them.
    ``persisted``: the rank's manifests (:func:`_manifests`)."""
    for it, entries in sorted(persisted.items()):
        for gen, key in entries:
            if gen < 0:  # a name of the first layout: its body says
                try:
                    gen = _read_manifest(storage, info.job, info.rank, it, key)[0].generation
                except CheckpointCorrupt:
                    continue  # a damaged manifest says nothing of its writer
            if gen > info.generation:
                raise StaleGeneration(
                    f"not persisted: iteration {info.iteration} of generation {info.generation} for "
                    f"{info.job!r} rank {info.rank}, and storage holds iteration {it} of generation {gen}")


def iterations(storage: Storage, job: str, rank: int) -> list[int]:
    """Iterations with a published manifest, oldest first (the manifests are not verified here)."""
    return sorted(_manifests(storage, job, rank))


def _read_manifest(
    storage: Storage, job: str, rank: int, iteration: int, key: str | None = None
) -> tuple[SnapshotInfo, dict[str, Any]]:
    """The manifest ``key``, or else the newest generation's of ``iteration``, checked."""
    named: int | None = None
    if key is None:
        entries = _manifests(storage, job, rank).get(iteration)
        if not entries:
            raise CheckpointCorrupt(f"missing: no manifest of iteration {iteration} under {rank_prefix(job, rank)}")
        named, key = entries[0]
    try:
        raw = jsontext.parse(storage.read(key), key)
        body = raw["body"]
        if raw.get("format") != 1:
            raise CheckpointCorrupt(f"{key}: unknown manifest format {raw.get('format')!r}")
        if crc(_canonical(body)) != raw["crc32"]:
            raise CheckpointCorrupt(f"checksum mismatch in {key}")
        info = SnapshotInfo.from_dict(body["info"])
        shards = body["shards"]
        meta = body["meta"]
        if not isinstance(shards, list) or not isinstance(meta, dict) or not isinstance(meta.get("key"), str):
            raise CheckpointCorrupt(f"{key}: malformed shard list or metadata entry")
    except ObjectMissing as exc:
        raise CheckpointCorrupt(f"manifest {key} vanished") from exc
    except (ValueError, KeyError, TypeError, InvalidRecord) as exc:
        raise CheckpointCorrupt(f"{key} unreadable: {exc}") from exc
    if (info.job, info.rank, info.iteration) != (job, rank, iteration) or named not in (None, -1, info.generation):
        raise CheckpointCorrupt(
            f"stale: {key} describes job {info.job!r} rank {info.rank} iteration {info.iteration} "
            f"generation {info.generation}"
        )
    expect = [(o, n, c) for (o, n), c in zip(info.chunks(), info.chunk_crcs, strict=True)]
    try:
        # JSON integers as they are: int() took "4096", which load() then sliced with (a TypeError)
        got = [(_integer(s["offset"]), _integer(s["length"]), _integer(s["crc32"])) for s in shards]
        if not all(isinstance(s["key"], str) for s in shards):
            raise TypeError("a shard's key is not a string")
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointCorrupt(f"{key}: malformed shard entry: {exc}") from exc
    if got != expect:
        raise CheckpointCorrupt(f"{key}: shard list does not cover the data as its info says")
    return info, body


def generation(storage: Storage, job: str, rank: int, iteration: int) -> int:
    """The task generation that wrote the rank's persisted ``iteration`` (the newest's manifest, checked)."""
    return _read_manifest(storage, job, rank, iteration)[0].generation


def _integer(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{value!r} is not an integer")
    return value


def _read_exact(storage: Storage, key: str, out: memoryview, what: str) -> None:
    try:
        size = storage.size(key)
    except ObjectMissing as exc:
        raise CheckpointCorrupt(f"partial: {what} {key} is missing") from exc
    if size != len(out):
        raise CheckpointCorrupt(f"partial: {what} {key} has {size} bytes, the manifest says {len(out)}")
    if storage.read_into(key, out) != len(out):
        raise CheckpointCorrupt(f"partial: {what} {key} was short")


def load(storage: Storage, job: str, rank: int, iteration: int, pool: Executor | None = None) -> Snapshot:
    """Read and verify every byte of one persisted snapshot; raises CheckpointCorrupt naming the bad part."""
    info, body = _read_manifest(storage, job, rank, iteration)
    meta = bytearray(info.meta_len)
    _read_exact(storage, body["meta"]["key"], memoryview(meta), "metadata")
    if crc(meta) != info.meta_crc:
        raise CheckpointCorrupt(f"checksum mismatch in metadata {body['meta']['key']}")
    data = byte_view(torch.empty(info.data_len, dtype=torch.uint8))

    def one(i: int) -> None:
        s = body["shards"][i]
        view = data[s["offset"] : s["offset"] + s["length"]]
        _read_exact(storage, s["key"], view, "shard")
        if crc(view) != s["crc32"]:
            raise CheckpointCorrupt(f"checksum mismatch in shard {i} ({s['key']})")

    indices = range(len(body["shards"]))
    if pool is None:
        for i in indices:
            one(i)
    else:
        for _ in pool.map(one, indices):
            pass
    return Snapshot(info=info, meta=bytes(meta), data=data)


def persisted_by_rank(storage: Storage, job: str) -> dict[int, set[int]]:
    """Every rank's persisted iterations, as their markers say (one listing)."""
    out: dict[int, set[int]] = {}
    for key in storage.list(f"{job}/persisted/"):
        m = _MARKER_RX.search(key)
        if m:
            out.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    return out


#: how far (in multiples of ``keep``) retention keeps iterations a lagging rank may still persist
LAG_WINDOW = 4


def _needed_line(storage: Storage, job: str, world_size: int) -> tuple[int, int | None] | None:
    """(line, common): the oldest of the ranks' newest persisted iterations (any rank may still persist
    an iteration from there on), and the newest iteration every rank holds (None: none). None when a
    rank below ``world_size`` has persisted nothing yet: any iteration may become the common one.
    ``world_size`` 0: the ranks that have markers."""
    held = persisted_by_rank(storage, job)
    if world_size > 0:
        held = {r: its for r, its in held.items() if r < world_size}
        if len(held) < world_size:
            return None
    if not held:
        return None
    line = min(max(its) for its in held.values())
    common = set.intersection(*held.values())
    return line, max(common, default=None)


def _write_generation(match: re.Match[str]) -> int:
    """The generation of the write a :data:`_WRITE_RX` match names (-1: a layout without one)."""
    return -1 if match.group(2) is None else int(match.group(2))


def _delete_iteration(storage: Storage, job: str, rank: int, iteration: int, generation: int | None = None) -> None:
    """Delete the rank's ``iteration``: what ``generation`` or an older one wrote of it (None: all). A
    newer generation's writer may be writing that iteration right now (its relaunch restored an older
    state and reached it again): deleting the whole iteration tore its shards under it, and its manifest
    then named bytes that were gone, while it was told "persisted"."""
    def ours(gen: int) -> bool:
        return generation is None or gen <= generation

    storage.delete(marker_key(job, rank, iteration))  # before its manifest: a marker never outlives it
    for gen, key in _manifests_of(storage, job, rank, iteration):
        if ours(gen):
            storage.delete(key)  # first: never a manifest naming deleted shards
    for key in storage.list(_iter_prefix(job, rank, iteration)):
        m = _WRITE_RX.search(key)
        if m is None or ours(_write_generation(m)):
            storage.delete(key)
    if _manifests_of(storage, job, rank, iteration):  # a newer generation's landed: its marker stays
        storage.write(marker_key(job, rank, iteration), b"")


def _manifests_of(storage: Storage, job: str, rank: int, iteration: int) -> list[tuple[int, str]]:
    """(generation by its name, key) of each manifest of the rank's ``iteration`` (see :func:`_manifests`)."""
    return _manifests(storage, job, rank, f"manifest-{iteration:012d}").get(iteration, [])


def apply_retention(
    storage: Storage, job: str, rank: int, keep: int, world_size: int = 0, generation: int | None = None,
    manifests: dict[int, list[tuple[int, str]]] | None = None,
) -> list[int]:
    """Delete all but the newest ``keep`` manifests (with their shards), and orphaned shards of writes
    that died before their manifest (see :func:`_sweep_orphans`). Returns deleted iterations.

    Never deleted, whatever ``keep`` says: the newest iteration every rank has persisted, and, among the
    newest ``keep * LAG_WINDOW``, any from the oldest of the ranks' newest ones on (a rank whose persists
    fail or lag would otherwise find the others' copies of its newest gone, and storage alone could
    restore nothing). The ranks are those with markers (below ``world_size`` when it is given; while one
    of them has none, the newest ``keep * LAG_WINDOW`` are kept).

    ``generation``: the caller's; nothing is deleted once storage holds a newer generation's manifest
    of the rank, and no write of a newer generation is taken for an orphan (it may be in progress).
    ``manifests``: the rank's, as the caller just listed them (a remote listing is I/O)."""
    if manifests is None:
        manifests = _manifests(storage, job, rank)
    if generation is not None and any(g > generation for v in manifests.values() for g, _ in v):
        return []
    its = sorted(manifests)
    old = its[:-keep] if keep > 0 else []
    if old:
        # what a lagging rank may still need is kept only so far back: a rank that stopped persisting
        # for good (left in an in-place shrink, excluded before its first persist) held the line down
        # and storage grew by a snapshot per persist for the rest of the job
        waiting = set(its[-keep * LAG_WINDOW:])
        needed = _needed_line(storage, job, world_size)
        if needed is None:
            old = [it for it in old if it not in waiting]
        else:
            line, common = needed
            old = [it for it in old if it != common and (it < line or it not in waiting)]
    gone = old
    for it in gone:
        _delete_iteration(storage, job, rank, it, generation)
    if its:
        _sweep_orphans(storage, job, rank, generation, manifests, set(its) - set(gone))
    return gone


def _sweep_orphans(
    storage: Storage, job: str, rank: int, generation: int | None, manifests: dict[int, list[tuple[int, str]]],
    kept: set[int],
) -> None:
    """Delete the writes that died before their manifest, none of a newer generation than ``generation``
    (a newer one's may be in progress). ``manifests``: the rank's (:func:`_manifests`, not empty).

    * Of an iteration older than the newest manifest: those not ``kept``.
    * At the newest manifest's iteration or above: those of an older generation than some manifest of
      the rank that no manifest names. Their writer, alive or killed, can never complete them (it checks
      for a newer generation's manifest before and after its own); a write of the newest generation may
      still be in progress, so it stays. They stayed for good before: a writer killed there (SIGKILL
      mid-persist) left its shards beside every later relaunch that trained no further."""
    newest = max(manifests)
    newest_generation = max(g for entries in manifests.values() for g, _ in entries)
    named: set[str] | None = None  # the writes the newest iteration's manifests name, read when needed
    orphans = set()
    under = f"{rank_prefix(job, rank)}iter-"
    # with the writes that left only a temporary (killed in their first shard): list() shows none of them
    for key in storage.list(under) + storage.list_incomplete(under):
        m = _WRITE_RX.search(key)
        if not m:
            continue
        it, gen, write = int(m.group(1)), _write_generation(m), key[: m.end()]
        if generation is not None and gen > generation:
            continue
        if it < newest:
            if it in kept:
                continue
        elif gen >= newest_generation:
            continue
        elif it == newest:
            if named is None:
                named = _named_writes(storage, [k for _, k in manifests[newest]])
            if write in named or not named:  # named, or a manifest unreadable: which write it names is unknown
                continue
        orphans.add(write)
    for prefix in sorted(orphans):
        _delete_prefix(storage, prefix)
        if left := storage.list_incomplete(prefix):  # nothing beside them now: deleting one removes them
            storage.delete(left[0])


def _named_writes(storage: Storage, manifests: list[str]) -> set[str]:
    """The writes (:data:`_WRITE_RX`) whose shards or metadata ``manifests`` name; empty when one of them
    cannot be read (gone, damaged): then any write may be its."""
    named = set()
    for key in manifests:
        try:
            body = jsontext.parse(storage.read(key), key)["body"]
            keys = [body["meta"]["key"], *(shard["key"] for shard in body["shards"])]
        except (ObjectMissing, ValueError, KeyError, TypeError, InvalidRecord):
            return set()
        for k in keys:
            if isinstance(k, str) and (m := _WRITE_RX.search(k)):
                named.add(k[: m.end()])
    return named


def discard_newer(
    storage: Storage, job: str, rank: int, iteration: int, held: Sequence[int] | None = None,
    generation: int | None = None,
) -> list[int]:
    """Delete persisted iterations newer than ``iteration`` (an abandoned timeline after a rollback).
    ``held``: the rank's iterations when the caller listed them already; ``generation``: the caller's,
    whose deletions leave a newer generation's writes alone (see :func:`_delete_iteration`)."""
    newer = [it for it in (iterations(storage, job, rank) if held is None else held) if it > iteration]
    for it in newer:
        _delete_iteration(storage, job, rank, it, generation)
    return newer
