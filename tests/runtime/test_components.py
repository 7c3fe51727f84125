"""The runtime's smaller parts in one process: the GPT and its attention, data, faults, checkpoints,
the command line."""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ckpt.api import NoValidCheckpoint, StorageUnavailable
from unicron.kernel.errors import ConfigError
from unicron.runtime import cli, train
from unicron.runtime.checkpoint import TorchSaveCheckpointer, make_checkpointer
from unicron.runtime.comm import broken_group, ensure_torch_distributed, solo_group
from unicron.runtime.data import FileTokens, SyntheticTokens, make_source
from unicron.runtime.faults import Fault, parse
from unicron.runtime.model import ModelConfig, build_gpt, lm_loss, rebind_groups
from unicron.runtime.scheduler import is_comm_error, starts_the_job
from unicron.runtime.state import OptimConfig, ReplicaState

SMALL = ModelConfig(layers=2, hidden=64, heads=4, seq=32, vocab=128, dtype="float64")


@pytest.fixture(scope="module")
def gpt() -> Any:
    ensure_torch_distributed()
    return build_gpt(SMALL, solo_group())


def test_gpt_uses_our_sdpa_attention_and_matches_a_naive_causal_attention(gpt: Any) -> None:
    attn = gpt.decoder.layers[0].self_attention.core_attention
    assert type(attn).__name__ == "SDPAttention"
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(6, 2, 4, 16, generator=g, dtype=torch.float64) for _ in range(3))  # [s, b, h, d]
    out = attn(q, k, v, None)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) / math.sqrt(16)
    scores = scores.masked_fill(torch.triu(torch.ones(6, 6, dtype=torch.bool), 1), float("-inf"))
    naive = torch.einsum("bhst,tbhd->sbhd", F.softmax(scores, -1), v).reshape(6, 2, 64)
    torch.testing.assert_close(out, naive)


def test_gpt_trains_on_cpu_in_float64(gpt: Any) -> None:
    assert {p.dtype for p in gpt.parameters()} == {torch.float64}
    data = SyntheticTokens(vocab=128, seq=32, micro_batch_size=4, seed=1)
    tokens, labels = data.batch(0, 0)
    loss = lm_loss(gpt, tokens, labels, solo_group())
    ref = F.cross_entropy(gpt(tokens, torch.arange(32).expand(4, 32), None).reshape(-1, 128), labels.reshape(-1))
    torch.testing.assert_close(loss, ref)
    loss.backward()  # type: ignore[no-untyped-call]
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in gpt.parameters())
    gpt.zero_grad(set_to_none=True)


def test_rebinding_moves_every_reference_to_the_new_group(gpt: Any) -> None:
    assert rebind_groups(gpt, solo_group(), broken_group()) > 0
    assert rebind_groups(gpt, solo_group(), broken_group()) == 0
    assert rebind_groups(gpt, broken_group(), solo_group()) > 0


def test_replica_state_round_trips_through_a_torch_save_checkpoint(gpt: Any, tmp_path: Path) -> None:
    state = ReplicaState(gpt, OptimConfig())
    state.iteration = 7
    ckpt = TorchSaveCheckpointer(str(tmp_path), rank=0, keep=1)
    with pytest.raises(NoValidCheckpoint):
        ckpt.restore()
    ckpt.save(state.state_dict(), 7)
    ckpt.save(state.state_dict(), 8)
    assert ckpt.held() == [8]  # keep=1: the older snapshot is gone
    other = ReplicaState(build_gpt(replace(SMALL, init_seed=99), solo_group()), OptimConfig())
    other.load_state_dict(ckpt.restore().state)
    assert other.iteration == 7
    assert all(torch.equal(a, b) for a, b in zip(other.tensors(), state.tensors(), strict=True))
    with pytest.raises(ConfigError, match="--ckpt-dir"):
        make_checkpointer("torch-save", "", "job", 0)


def test_a_snapshot_of_parameters_the_model_lacks_is_refused_not_half_loaded() -> None:
    """load_state_dict(strict=False) took a snapshot whose parameter names differ (shapes alike): the
    optimizer state and iteration loaded, the parameters silently stayed at their initialisation. Now
    one error naming what differs, and nothing of the snapshot is loaded."""
    from unicron.runtime.state import SnapshotMismatch

    torch.manual_seed(0)
    saved = ReplicaState(torch.nn.Sequential(torch.nn.Linear(4, 3)), OptimConfig())
    saved.iteration = 5
    snapshot = saved.state_dict()
    renamed = {**snapshot, "model": {f"layer.{k}": v for k, v in snapshot["model"].items()}}
    target = ReplicaState(torch.nn.Sequential(torch.nn.Linear(4, 3)), OptimConfig())
    with pytest.raises(SnapshotMismatch, match=r"lacks \['0.bias', '0.weight'\].*has \['layer.0.bias'"):
        target.load_state_dict(renamed)
    assert target.iteration == 0
    target.load_state_dict(snapshot)
    assert all(torch.equal(a, b) for a, b in zip(target.tensors(), saved.tensors(), strict=True))


def test_a_snapshot_of_other_shapes_or_dtypes_is_refused_with_both_shapes_not_half_loaded() -> None:
    """--resume with another --hidden: torch's load_state_dict raised its size-mismatch RuntimeError (a
    71-line traceback) after loading the tensors before it; a float32 snapshot loaded silently into a
    float64 model. Now SnapshotMismatch (one line), naming the tensors with both shapes, loading nothing."""
    from unicron.runtime.state import SnapshotMismatch

    torch.manual_seed(0)
    saved = ReplicaState(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)), OptimConfig())
    saved.iteration = 5
    wider = ReplicaState(torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2)), OptimConfig())
    before = [t.clone() for t in wider.tensors()]
    with pytest.raises(SnapshotMismatch, match=r"0\.weight \[3, 4\] float32 in the snapshot, \[6, 4\] float32 here;"
                       r".*\(3 of 3 tensors that differ\); relaunch with the model flags the snapshot was "
                       r"written with, or without --resume"):
        wider.load_state_dict(saved.state_dict())
    assert wider.iteration == 0
    assert all(torch.equal(a, b) for a, b in zip(wider.tensors(), before, strict=True))
    double = ReplicaState(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).double(), OptimConfig())
    with pytest.raises(SnapshotMismatch, match=r"0\.bias \[3\] float32 in the snapshot, \[3\] float64 here"):
        double.load_state_dict(saved.state_dict())
    assert double.iteration == 0


_WRITER = """
import os, sys, time, torch
from unicron.runtime.checkpoint import TorchSaveCheckpointer
directory, rank, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
ck = TorchSaveCheckpointer(directory, rank)
# the temp file is written and synced; the writer dies (or hangs) before its rename
os.replace = (lambda *a: os.kill(os.getpid(), 9)) if mode == "die" else (lambda *a: time.sleep(300))
ck.save({"w": torch.zeros(8)}, 3)
"""


def test_a_torch_save_writer_killed_mid_save_leaves_no_temp_file_once_its_rank_restarts(tmp_path: Path) -> None:
    """A writer killed between writing it<N>.pt's temp file and its rename left the (full-size) temp
    file for good: held() and pruning see only it<N>.pt, so each death grew the directory. Now a rank's
    checkpointer removes its own dead writers' temp files when built and after each save, and never a
    live writer's or another rank's (the shard's directory is shared)."""
    import subprocess
    import sys

    def writer(rank: int, mode: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), str(rank), mode])

    def temps() -> set[str]:
        return {p.name for p in (tmp_path / "tp0").glob("it*.pt.[0-9]*.tmp")}  # the checkpoints' (not sidecars')

    live0 = writer(0, "hang")  # first: a rank 0 started after a dead one would already clean up
    dead0 = dead1 = live0
    try:
        deadline = time.monotonic() + 120
        while not temps() and time.monotonic() < deadline:
            time.sleep(0.05)
        dead0, dead1 = writer(0, "die"), writer(1, "die")
        assert dead0.wait(120) == -9 and dead1.wait(120) == -9
        assert len(temps()) == 3, temps()
        other_host = f"it2.pt.0.elsewhere.{dead0.pid}.tmp"  # another host's writer: its pid means nothing here
        (tmp_path / "tp0" / other_host).write_bytes(b"partial")
        orphan = next(n for n in temps() if n.endswith(f".{dead0.pid}.tmp") and n != other_host)
        ck = TorchSaveCheckpointer(str(tmp_path), rank=0)
        left = temps()
        assert orphan not in left and len(left) == 3 and other_host in left
        assert any(n.endswith(f".{live0.pid}.tmp") for n in left)  # alive: still writing
        assert any(n.endswith(f".{dead1.pid}.tmp") for n in left)  # rank 1's: rank 1 removes it
        live0.kill()
        live0.wait(60)
        ck.save({"w": torch.ones(8)}, 4)  # the next save removes the writer that died since
        assert temps() == {other_host, next(n for n in left if n.endswith(f".{dead1.pid}.tmp"))}
        assert ck.held() == [4]
        sidecar_temps = {p.name for p in (tmp_path / "tp0").glob("it*.pt.sum.*.tmp")}  # as removed
        assert {n.rsplit(".", 2)[1] for n in sidecar_temps} == {str(dead1.pid)}, sidecar_temps
    finally:
        for p in (dead0, dead1, live0):
            p.kill()
            p.wait()


@pytest.mark.parametrize("fails_in", ["fsync", "torch.save"])
def test_a_torch_save_that_fails_on_a_full_disk_leaves_no_temp_file_and_the_previous_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fails_in: str) -> None:
    """A full disk: the save raised a bare OSError (or torch's RuntimeError "unexpected pos", the ENOSPC
    in its chain) that killed the rank, and left its partial temp file to keep the disk full. Now it
    removes the file and raises StorageUnavailable naming the directory and the OS error."""
    import errno
    import os

    ck = TorchSaveCheckpointer(str(tmp_path), rank=0)
    ck.save({"w": torch.ones(8)}, 1)
    enospc = OSError(errno.ENOSPC, "No space left on device")
    if fails_in == "fsync":
        def fsync(fd: int) -> None:
            raise enospc
        monkeypatch.setattr(os, "fsync", fsync)
    else:
        def save(obj: object, f: Any) -> None:
            f.write(b"partial")
            try:
                raise enospc
            except OSError:  # as torch's stream writer reports its write's failure
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0") from None
        monkeypatch.setattr(torch, "save", save)
    with pytest.raises(StorageUnavailable, match=rf"not saved in {tmp_path}/tp0: \[Errno 28\] No space left"):
        ck.save({"w": torch.zeros(8)}, 2)
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "tp0").iterdir()) == ["it1.pt", "it1.pt.sum"]
    assert torch.equal(ck.restore().state["w"], torch.ones(8))


def test_torch_save_restore_skips_a_damaged_newest_file_for_the_newest_valid_one(tmp_path: Path) -> None:
    """A torn newest file (a node crash before it reached the disk) made torch.load's RuntimeError
    escape restore(), so CheckpointSource never fell back and the resuming rank died; now restore()
    passes it over (named in ``skipped``) and the group resumes the previous snapshot."""
    from unicron.runtime.state import CheckpointSource

    def state(seed: int, iteration: int) -> ReplicaState:
        torch.manual_seed(seed)
        st = ReplicaState(torch.nn.Linear(4, 3).double(), OptimConfig())
        st.iteration = iteration
        return st

    ck = TorchSaveCheckpointer(str(tmp_path), rank=0)
    good = state(1, 4)
    ck.save(good.state_dict(), 4)
    ck.save(state(2, 5).state_dict(), 5)
    newest = Path(ck._path(5))
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    restored = ck.restore()
    assert restored.iteration == 4 and [a.iteration for a in restored.skipped] == [5]
    Path(f"{newest}.sum").unlink()  # as written before checksum sidecars: torch.load judges alone
    newest.write_bytes(b"torn")  # torch.load's unpickler: an IndexError, not a RuntimeError
    assert ck.restore().iteration == 4
    with pytest.raises(NoValidCheckpoint, match="unreadable"):
        ck.restore(iteration=5)
    resumed = state(7, 0)
    assert CheckpointSource(ck).transfer(resumed, solo_group(), [0], [], [0], 0)
    assert resumed.iteration == 4
    assert all(torch.equal(a, b) for a, b in zip(resumed.tensors(), good.tensors(), strict=True))


def test_torch_save_restore_passes_over_a_bit_rotted_newest_file(tmp_path: Path) -> None:
    """Review (bit rot): torch.load trusts the bytes, so one flipped bit in a checkpoint's tensor data
    restored wrong weights silently. Each it<N>.pt now has a checksum sidecar; a file that does not
    match it is passed over like a torn one; a file without one (written before) still loads."""
    ck = TorchSaveCheckpointer(str(tmp_path), rank=0)
    for it in (1, 2):
        ck.save({"w": torch.full((65536,), float(it)), "iteration": it}, it)
    newest = Path(ck._path(2))
    raw = bytearray(newest.read_bytes())
    at = raw.find(torch.full((4,), 2.0).numpy().tobytes()) + 4000
    raw[at + 3] ^= 0x40  # one bit of one float32 in the middle of the tensor data
    newest.write_bytes(bytes(raw))
    restored = ck.restore()
    assert restored.iteration == 1 and torch.equal(restored.state["w"], torch.full((65536,), 1.0))
    assert [(a.iteration, a.reason) for a in restored.skipped] == [(2, "checksum mismatch (bit rot, or a copy "
                                                                      "damaged in transit)")]
    assert ck.read_shard(0, 2)[0].iteration == 1  # a reader of the shared shard passes it over too
    Path(f"{ck._path(1)}.sum").unlink()  # a checkpoint written before sidecars existed
    assert ck.restore(iteration=1).state["iteration"] == 1


def test_a_ckpt_dir_that_cannot_be_created_is_a_config_error(tmp_path: Path) -> None:
    """--ckpt torch-save --ckpt-dir on a path under a plain file: os.makedirs's OSError escaped
    api.build (which turns only ConfigError/TemporaryError into one line), a traceback; now a
    ConfigError naming the flag, as --ckpt-storage's already was."""
    afile = tmp_path / "plain-file"
    afile.write_text("x")
    for where in (afile, afile / "sub"):
        with pytest.raises(ConfigError, match=f"--ckpt-dir {str(where)!r}: "):
            make_checkpointer("torch-save", str(where), "job", 0)


def test_when_every_copy_of_the_newest_is_damaged_the_group_restores_the_newest_valid_any_member_holds(
        tmp_path: Path) -> None:
    """Two replicas with checkpointers of their own: rank 0 holds iterations 2 and a torn 6, rank 1 a
    valid 5. The holder of the newest (rank 0) fell back to its own newest valid one, 2, and the group
    resumed there; now the members claim again and rank 1's 5 is restored."""
    from tests.runtime.threads import run_ranks
    from unicron.runtime.comm import HashStore, new_group
    from unicron.runtime.state import CheckpointSource

    def state(seed: int, iteration: int) -> ReplicaState:
        torch.manual_seed(seed)
        st = ReplicaState(torch.nn.Linear(4, 3).double(), OptimConfig())
        st.iteration = iteration
        return st

    cks = [TorchSaveCheckpointer(str(tmp_path / f"rank{r}"), rank=r, keep=3) for r in range(2)]
    cks[0].save(state(2, 2).state_dict(), 2)
    cks[0].save(state(6, 6).state_dict(), 6)
    Path(cks[0]._path(6)).write_bytes(b"torn")
    at5 = state(5, 5)
    cks[1].save(at5.state_dict(), 5)
    store = HashStore()

    def rank(r: int) -> tuple[int, list[torch.Tensor]]:
        group = new_group("gloo", store, "t", r, 2, 20.0)
        resumed = state(7, 0)
        assert CheckpointSource(cks[r]).transfer(resumed, group, [0, 1], [], [0, 1], r)
        return resumed.iteration, resumed.tensors()

    for it, tensors in run_ranks(2, rank, timeout_s=30):
        assert it == 5
        assert all(torch.equal(a, b) for a, b in zip(tensors, at5.tensors(), strict=True))


def _normed(seed: int, steps: int) -> ReplicaState:
    """A replica whose buffers training changes (a norm's running statistics and its batch count)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)).double()
    for _ in range(steps):
        model(torch.randn(8, 4, dtype=torch.float64))
    return ReplicaState(model, OptimConfig())


@pytest.mark.parametrize("source", ["replica", "checkpoint"])
def test_a_joiner_receives_the_models_buffers_with_its_parameters(source: str, tmp_path: Path) -> None:
    """Only parameters and optimizer state were sent: a joiner kept its own running statistics (and a
    Megatron MoE router its own expert bias), so its replica silently differed from the others'. Now
    the buffers travel with them, from a healthy replica and from the group's restored snapshot."""
    from tests.runtime.threads import run_ranks
    from unicron.runtime.comm import HashStore, new_group
    from unicron.runtime.state import CheckpointSource, ReplicaBroadcast, StateSource

    holder = _normed(1, steps=5)
    ck = TorchSaveCheckpointer(str(tmp_path / "rank0"), rank=0, keep=1)
    ck.save(holder.state_dict(), 0)
    store = HashStore()
    states = [_normed(1, steps=5), _normed(2, steps=1)]  # here: the ranks' threads share one generator

    def rank(r: int) -> list[torch.Tensor]:
        group = new_group("gloo", store, "t", r, 2, 20.0)
        mine = states[r]
        src: StateSource = ReplicaBroadcast() if source == "replica" else CheckpointSource(
            ck if r == 0 else TorchSaveCheckpointer(str(tmp_path / "rank1"), rank=1, keep=1))
        holders = [0] if source == "replica" else []
        assert src.transfer(mine, group, [0, 1], holders, [1] if source == "replica" else [0, 1], r)
        return mine.buffers()

    assert [b.dtype for b in holder.buffers()] == [torch.float64, torch.float64, torch.int64]
    for got in run_ranks(2, rank, timeout_s=30):
        assert all(torch.equal(a, b) for a, b in zip(got, holder.buffers(), strict=True))


def test_the_memory_checkpointer_reads_its_tunables_from_the_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/ckpt.md's UNICRON_CKPT_* variables reach the manager the runtime builds (they were ignored:
    ``--ckpt memory`` always ran with the defaults, overlap off); the flags' own values still win."""
    from ckpt.manager import CheckpointManager

    monkeypatch.setenv("UNICRON_CKPT_SLOTS", "3")
    monkeypatch.setenv("UNICRON_CKPT_OVERLAP", "1")
    monkeypatch.setenv("UNICRON_CKPT_PERSIST_EVERY", "7")
    ck = make_checkpointer("memory", str(tmp_path), "job", 0, persist_every=2)
    assert isinstance(ck, CheckpointManager)
    try:
        assert (ck.config.slots, ck.config.overlap, ck.config.persist_every) == (3, True, 2)
        assert ck.config.local_dir == str(tmp_path / "rank-0")
    finally:
        ck.close()
    monkeypatch.setenv("UNICRON_CKPT_SLOTS", "three")
    with pytest.raises(ConfigError, match="UNICRON_CKPT_SLOTS: bad value 'three'"):
        make_checkpointer("memory", str(tmp_path), "job", 0)


def test_resume_tells_no_checkpoint_from_a_remote_tier_out_of_reach(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An I/O error listing the storage made --resume start afresh, and the fresh run's persisted saves
    then discarded the real snapshots once the storage answered again."""
    from ckpt.manager import CheckpointManager
    from tests.ckpt.test_storage import _fail_scandir_under
    from unicron.runtime.checkpoint import Presence, checkpoint_presence

    ck = make_checkpointer("memory", str(tmp_path), "job", 0)
    assert isinstance(ck, CheckpointManager)
    try:
        assert checkpoint_presence(ck) is Presence.NONE  # a first launch
        with monkeypatch.context() as m:
            _fail_scandir_under(m, tmp_path / "persisted")
            assert checkpoint_presence(ck) is Presence.UNKNOWN
        assert ck.save({"w": torch.zeros(4)}, 1).result(30).published
        with monkeypatch.context() as m:  # a tier holding it is enough, whatever the others say
            _fail_scandir_under(m, tmp_path / "persisted")
            assert checkpoint_presence(ck) is Presence.FOUND
    finally:
        ck.close()


def test_data_depends_only_on_iteration_and_micro_batch(tmp_path: Path) -> None:
    gen = make_source(None, vocab=128, seq=16, micro_batch_size=2, seed=3)
    a, b = gen.batch(4, 1), gen.batch(4, 1)
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], gen.batch(4, 2)[0])
    assert torch.equal(a[0][:, 1:], a[1][:, :-1])  # labels are the next tokens
    np.save(tmp_path / "toks.npy", np.arange(1000) % 97)
    (tmp_path / "text.txt").write_bytes(b"hello unicron " * 20)
    for name in ("toks.npy", "text.txt"):
        src = make_source(str(tmp_path / name), vocab=128, seq=8, micro_batch_size=2, seed=3)
        assert isinstance(src, FileTokens)
        tokens, _ = src.batch(0, 5)
        assert tokens.shape == (2, 8) and int(tokens.max()) < 128
    with pytest.raises(ConfigError, match="does not exist"):
        make_source(str(tmp_path / "missing"), 128, 8, 2, 3)


def test_file_token_windows_reach_the_files_last_token(tmp_path: Path) -> None:
    """A window's start was drawn below numel - seq - 1, one short: the file's last token was never
    in any window, and a file of exactly seq+1 tokens was refused; now every start is drawn."""
    np.save(tmp_path / "toks.npy", np.arange(10))
    src = make_source(str(tmp_path / "toks.npy"), vocab=128, seq=8, micro_batch_size=4, seed=3)
    assert any(int(src.batch(it, 0)[1][:, -1].max()) == 9 for it in range(8))  # the last label
    np.save(tmp_path / "short.npy", np.arange(9))
    tokens, labels = make_source(str(tmp_path / "short.npy"), 128, 8, 1, 3).batch(0, 0)
    assert tokens.tolist() == [list(range(8))] and labels.tolist() == [list(range(1, 9))]


@pytest.mark.parametrize("content", ["not a numpy file", "pickled objects"])
def test_a_data_file_that_is_not_a_token_array_is_one_line_not_a_traceback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], content: str) -> None:
    """A --data-file .npy that np.load cannot map (not an .npy at all, or an array of pickled objects)
    was numpy's ValueError traceback; now one line naming the file (exit EXIT_CONFIG)."""
    for var, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(var, value)
    bad = tmp_path / "tokens.npy"
    if content == "pickled objects":
        np.save(bad, np.array([{"a": 1}, {"b": 2}], dtype=object), allow_pickle=True)
    else:
        bad.write_bytes(b"this is not an npy file at all" * 10)
    assert train.main(["--data-file", str(bad)]) == train.EXIT_CONFIG
    err = capsys.readouterr().err.strip()
    assert f"--data-file {str(bad)!r}: not a .npy of token ids" in err and "\n" not in err


def test_fault_scripts_parse_and_reject_garbage() -> None:
    assert parse("die@2:mb1, raise@3:start:connection_refused_reset") == [
        Fault("die", 2, "mb1"), Fault("raise", 3, "start", "connection_refused_reset"),
    ]
    for bad in ("die@x:mb1", "explode@1:mb0", "raise@1:start:not_a_kind"):
        with pytest.raises(ConfigError):
            parse(bad)


def test_comm_errors_are_recognised_through_the_exception_chain() -> None:
    gloo = RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer")
    try:
        try:
            raise gloo
        except RuntimeError as inner:
            raise ValueError("Process group is not initialized in the world group map") from inner
    except ValueError as outer:
        assert is_comm_error(outer)
    assert not is_comm_error(RuntimeError("shape mismatch"))


def test_cli_registers_train_and_reports_bad_settings_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(["train", "--tp", "2", "--deterministic"])
    assert args.func is not None and args.tp == 2 and args.deterministic
    with pytest.MonkeyPatch.context() as mp:
        for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            mp.delenv(var, raising=False)
        assert train.main([]) == train.EXIT_CONFIG
        assert "RANK is not set" in capsys.readouterr().err
        mp.setenv("RANK", "0")
        mp.setenv("WORLD_SIZE", "2")
        mp.setenv("MASTER_ADDR", "127.0.0.1")
        mp.setenv("MASTER_PORT", "1")
        assert train.main(["--global-batch-size", "30", "--micro-batch-size", "4"]) == train.EXIT_CONFIG
        assert "--global-batch-size 30" in capsys.readouterr().err
        assert train.main(["--tp", "3"]) == train.EXIT_CONFIG
        assert "--tp 3" in capsys.readouterr().err
        assert train.main(["--backend", "nccl", "--device", "cpu"]) == train.EXIT_CONFIG
        err = capsys.readouterr().err
        assert "--backend nccl reduces CUDA tensors only" in err and len(err.strip().splitlines()) == 1
        if not torch.cuda.is_available():
            assert train.main(["--backend", "nccl"]) == train.EXIT_CONFIG
            err = capsys.readouterr().err
            assert "--device cuda: LOCAL_RANK=0 but this rank sees 0 GPU(s)" in err, err
            assert len(err.strip().splitlines()) == 1


def test_only_a_first_process_on_the_launchs_store_starts_the_job() -> None:
    assert starts_the_job(incarnation=1, store_epoch=0)
    assert not starts_the_job(incarnation=2, store_epoch=0)  # a restarted process joins
    # a moved store lacks the counters of ranks its re-seeders no longer held: incarnation 1 there is a
    # returning rank of a running job
    assert not starts_the_job(incarnation=1, store_epoch=6)
