"""``unicron train`` flags: every one has an environment fallback named in its help."""

from __future__ import annotations

import argparse
import gc
from pathlib import Path

import pytest

from unicron.kernel.errors import ConfigError
from unicron.runtime.api import configs
from unicron.runtime.cli import add_arguments, env_name
from unicron.runtime.gcpolicy import GcPolicy


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p


def test_every_flag_names_its_environment_variable() -> None:
    p = _parser()
    flags = [a for a in p._actions if a.option_strings and a.dest != "help"]
    assert len(flags) > 20
    for action in flags:
        assert env_name(action.option_strings[0]) in (action.help or ""), action.option_strings


def test_environment_sets_the_default_and_the_flag_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UNICRON_TRAIN_LAYERS", "6")
    monkeypatch.setenv("UNICRON_TRAIN_DETERMINISTIC", "true")
    monkeypatch.setenv("UNICRON_TRAIN_MANUAL_GC_INTERVAL", "50")
    args = _parser().parse_args([])
    assert (args.layers, args.deterministic, args.manual_gc_interval) == (6, True, 50)
    assert _parser().parse_args(["--layers", "3"]).layers == 3


def test_a_bad_environment_value_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("UNICRON_TRAIN_HIDDEN", "wide")
    with pytest.raises(SystemExit):
        _parser().parse_args([])
    err = capsys.readouterr().err
    assert "--hidden" in err and "UNICRON_TRAIN_HIDDEN" in err and "'wide'" in err


@pytest.mark.parametrize("raw", ["nan", "inf", "-inf"])
def test_a_float_flag_must_be_finite(
    raw: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """A NaN timeout passed the runtime's "regroup > collective" check (comparisons with NaN are false)."""
    with pytest.raises(SystemExit):
        _parser().parse_args([f"--collective-timeout={raw}"])
    assert f"argument --collective-timeout: '{raw}' is not a valid number" in capsys.readouterr().err
    monkeypatch.setenv("UNICRON_TRAIN_LR", raw)
    with pytest.raises(SystemExit):
        _parser().parse_args([])
    assert "UNICRON_TRAIN_LR" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    # each was accepted before: a negative --iter-sleep then raised in time.sleep mid-iteration, and
    # --bucket-elems 0 gave one-element buckets (a bucket, and a reduction, per parameter element)
    (["--collective-timeout=0"], "--collective-timeout must be > 0, got 0.0"),
    (["--join-timeout=-1"], "--join-timeout must be > 0, got -1.0"),
    (["--iter-sleep=-0.5"], "--iter-sleep must be >= 0, got -0.5"),
    (["--bucket-elems=0"], "--bucket-elems must be >= 1, got 0"),
    (["--blocks=-2"], "--blocks must be >= 0, got -2"),
])
def test_runtime_settings_out_of_range_are_config_errors(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        configs(_parser().parse_args(argv))
    assert str(err.value) == message


def test_a_negative_seed_is_refused_at_start() -> None:
    """--seed -1 was accepted, then with --data-path every rank crashed on its first micro-batch
    (numpy's default_rng takes no negative seed); now one line at start."""
    with pytest.raises(ConfigError, match=r"^--seed must be >= 0, got -1$"):
        configs(_parser().parse_args(["--seed", "-1"]))
    assert configs(_parser().parse_args(["--seed", "0"]))[1].seed == 0


def test_an_init_seed_out_of_torchs_range_is_refused_at_start() -> None:
    """--init-seed beyond 64 bits was torch.manual_seed's ValueError traceback at model build; now one
    line at start, and torch's whole range is still accepted."""
    for bad in (2**64, -(2**63) - 1):
        with pytest.raises(ConfigError, match=f"^--init-seed must be .*, got {bad}$"):
            configs(_parser().parse_args(["--init-seed", str(bad)]))
    for edge in (2**64 - 1, -(2**63)):
        configs(_parser().parse_args(["--init-seed", str(edge)]))


def test_manual_gc_collects_only_at_the_boundaries() -> None:
    policy = GcPolicy(interval=3)
    try:
        policy.after_setup()
        assert not gc.isenabled() and gc.get_freeze_count() > 0
        before = gc.get_stats()[2]["collections"]
        for it in range(1, 7):
            policy.at_boundary(it)
        assert gc.get_stats()[2]["collections"] - before == 2  # iterations 3 and 6
    finally:
        policy.close()
        gc.unfreeze()
    assert gc.isenabled()


def _one_line_error(code: int, capsys: pytest.CaptureFixture[str], naming: str) -> None:
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and naming in err and "Traceback" not in err, (code, err)


def test_a_bad_log_level_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from unicron.runtime.train import main
    monkeypatch.setenv("UNICRON_LOG_LEVEL", "bogus")
    _one_line_error(main([]), capsys, "UNICRON_LOG_LEVEL")


def test_an_out_dir_that_cannot_be_made_is_refused_at_start(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """--out-dir is written when the rank ends: a path under a file failed there, with a traceback,
    after the whole training. (No store runs: the flag is refused before the rank connects.)"""
    from unicron.runtime.train import main
    (tmp_path / "file").write_text("x")
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    _one_line_error(main(["--iterations", "1", "--out-dir", str(tmp_path / "file" / "out")]), capsys, "--out-dir")


def test_a_bad_boolean_environment_value_is_one_line_and_the_config_exit_status(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """UNICRON_TRAIN_DETERMINISTIC=maybe ended the rank with SystemExit(message): exit 1, where a bad
    setting's documented status (docs/runtime.md) is 2."""
    monkeypatch.setenv("UNICRON_TRAIN_DETERMINISTIC", "maybe")
    with pytest.raises(SystemExit) as exc:
        _parser()
    assert isinstance(exc.value.code, int)
    _one_line_error(exc.value.code, capsys, "UNICRON_TRAIN_DETERMINISTIC='maybe': expected true or false")


def test_a_generation_that_is_not_an_integer_is_one_line(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """AgentClient.from_env's int(UNICRON_GENERATION) raised ValueError: a 22-line traceback naming no
    variable. (No store runs: the variable is refused before the rank connects.)"""
    from unicron.runtime.train import main
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "1", "UNICRON_GENERATION": "abc"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("UNICRON_AGENT_SOCKET", raising=False)
    _one_line_error(main(["--iterations", "1"]), capsys, "UNICRON_GENERATION='abc' is not an integer")


def test_replica_peers_that_are_not_host_port_are_a_config_error_naming_the_variable(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """UNICRON_CKPT_PEERS=garbage raised InvalidRecord, which api.run does not catch: a traceback."""
    from unicron.runtime.checkpoint import make_checkpointer
    monkeypatch.setenv("UNICRON_CKPT_PEERS", "127.0.0.1:7000, garbage")
    with pytest.raises(ConfigError, match=r"UNICRON_CKPT_PEERS='127.0.0.1:7000, garbage': 'garbage' is not "
                                          r"host:port; expected .* comma-separated host:port"):
        make_checkpointer("memory", str(tmp_path), "job", 0)
    # '²'.isdigit() held and int() raised ValueError: a traceback in every rank of the node
    for port in ("\u00b2", "1" * 5000):
        monkeypatch.setenv("UNICRON_CKPT_PEERS", f"10.0.0.2:{port}")
        with pytest.raises(ConfigError, match=r"^environment variable UNICRON_CKPT_PEERS=.* is not host:port"):
            make_checkpointer("memory", str(tmp_path), "job", 0)


def test_the_restore_peers_the_agent_names_are_asked_on_restore(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The manager was built with UNICRON_CKPT_PEERS only (this node's ring successor), so a rank relaunched
    on another node never asked the server that held its replica. Pushes still go to the ring successor."""
    from ckpt.manager import CheckpointManager
    from unicron.runtime.checkpoint import make_checkpointer
    monkeypatch.setenv("UNICRON_CKPT_PEERS", "127.0.0.1:7001")
    monkeypatch.setenv("UNICRON_CKPT_RESTORE_PEERS", "127.0.0.1:7000,127.0.0.1:7001,127.0.0.1:7002")
    m = make_checkpointer("memory", str(tmp_path), "job", 0, storage="none")
    assert isinstance(m, CheckpointManager)
    try:
        assert [p.describe() for p in m.peers] == ["127.0.0.1:7001"]
        assert [p.describe() for p in m.restore_peers] == ["127.0.0.1:7000", "127.0.0.1:7002"]
    finally:
        m.close()
    monkeypatch.setenv("UNICRON_CKPT_RESTORE_PEERS", "garbage")
    with pytest.raises(ConfigError, match=r"^environment variable UNICRON_CKPT_RESTORE_PEERS='garbage': 'garbage' is not"):
        make_checkpointer("memory", str(tmp_path), "job", 0, storage="none")
