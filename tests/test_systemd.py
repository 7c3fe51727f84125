"""The systemd units in systemd/: ``systemd-analyze verify`` accepts them, and they keep the settings
the deployment relies on (docs/api.md, "Running under systemd").

``verify`` checks that ExecStart= is executable, so the units are checked in a copy whose
/opt/unicron/.venv (the install layout) is replaced by the venv running the tests.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agent.settings import AgentSettings
from coordinator.settings import CoordinatorSettings

ROOT = Path(__file__).resolve().parents[1]
UNITS = ROOT / "systemd"
INSTALL_VENV = "/opt/unicron/.venv"


def _systemd_analyze() -> str:
    found = shutil.which("systemd-analyze")
    if found:
        return found
    # The issue asks for the check to install systemd's tools where they are missing, when it can.
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip("systemd-analyze is missing and cannot be installed here (needs root and apt-get)")
    proc = subprocess.run(["apt-get", "install", "-y", "-qq", "systemd"], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    found = shutil.which("systemd-analyze")
    if proc.returncode != 0 or not found:
        pytest.skip(f"systemd-analyze is missing and 'apt-get install systemd' failed: {proc.stderr[-300:]}")
    return found


def _parse(path: Path) -> dict[str, list[str]]:
    """``Section.Key`` -> values in order (systemd keys may repeat, so not configparser)."""
    out: dict[str, list[str]] = {}
    section = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return out


def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = _systemd_analyze()
    venv = Path(sys.prefix)
    copies = []
    for name in ("unicron-agent.service", "unicron-coordinator.service"):
        text = (UNITS / name).read_text()
        assert INSTALL_VENV in text, f"{name}: ExecStart= should point into {INSTALL_VENV}"
        copy = tmp_path / name
        copy.write_text(text.replace(INSTALL_VENV, str(venv)))
        copies.append(copy)
    try:
        proc = subprocess.run([analyze, "verify", "--man=no", *map(str, copies)],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"systemd-analyze cannot run here: {exc}")
    output = proc.stdout + proc.stderr
    # verify also loads the units ours depend on (etcd.service, ...); only complaints about ours count
    ours = [line for line in output.splitlines() if "unicron-" in line]
    assert proc.returncode == 0 and not ours, output


@pytest.mark.parametrize("name", ["unicron-agent.service", "unicron-coordinator.service"])
def test_units_keep_ordering_restart_and_hardening(name: str) -> None:
    unit = _parse(UNITS / name)
    for dep in ("network-online.target", "etcd.service"):
        assert dep in " ".join(unit["Unit.After"]) and dep in " ".join(unit["Unit.Wants"])
    expected = {
        "Service.Restart": "on-failure", "Service.NoNewPrivileges": "yes", "Service.ProtectSystem": "strict",
        "Service.PrivateTmp": "yes",
    }
    for key, value in expected.items():
        assert unit.get(key) == [value], key
    assert unit["Service.ExecStart"][0].startswith(f"{INSTALL_VENV}/bin/unicron-")
    assert unit["Service.EnvironmentFile"][0].startswith("-/etc/unicron/")
    assert "Service.RestartSec" in unit and "Service.LimitNOFILE" in unit and "Service.ProtectHome" in unit


def test_agent_unit_keeps_gpus_reachable_and_ranks_owned() -> None:
    unit = _parse(UNITS / "unicron-agent.service")
    assert unit["Service.KillMode"] == ["mixed"]
    assert unit["Service.RuntimeDirectory"] == ["unicron"]
    # the ranks' logs live there: removed with the unit, the logs of a crash went with the agent
    assert unit["Service.RuntimeDirectoryPreserve"] == ["yes"]
    assert unit["Service.PrivateDevices"] == ["no"]
    # each of these would restrict /dev (an allow-list without the GPUs) or block loading nvidia-uvm
    for key in ("Service.DeviceAllow", "Service.DevicePolicy", "Service.ProtectClock",
                "Service.ProtectKernelModules", "Service.DynamicUser"):
        assert key not in unit, key
    assert unit["Service.OOMPolicy"] == ["continue"]


@pytest.mark.parametrize(("example", "settings"), [
    ("agent.env.example", AgentSettings), ("coordinator.env.example", CoordinatorSettings),
])
def test_env_examples_name_only_real_settings(example: str, settings: type[Any]) -> None:
    known = {f.metadata["env"] for f in dataclasses.fields(settings) if "env" in f.metadata}
    names = []
    for raw in (UNITS / example).read_text().splitlines():
        line = raw.lstrip("#").strip()
        if line.startswith("UNICRON_") and "=" in line:
            names.append(line.split("=", 1)[0])
    assert names, f"{example} names no setting"
    assert set(names) <= known, f"{example}: unknown settings {sorted(set(names) - known)}"


def test_the_coordinators_dynamic_user_is_given_its_tls_key_as_a_credential() -> None:
    """``DynamicUser=yes`` cannot read root's 0600 key in UNICRON_TLS_DIR (what 'unicron certs issue'
    writes and docs/api.md copies there): the coordinator exited with a traceback and was restarted
    every 2 s forever. The unit passes the key of the example's directory and default name instead."""
    unit = _parse(UNITS / "unicron-coordinator.service")
    assert unit["Service.DynamicUser"] == ["yes"]
    env = dict(line.split("=", 1) for line in (UNITS / "coordinator.env.example").read_text().splitlines()
               if line.startswith("UNICRON_TLS_DIR="))
    name = next(f.default for f in dataclasses.fields(CoordinatorSettings) if f.name == "tls_name")
    assert unit["Service.LoadCredential"] == [f"{name}.key:{env['UNICRON_TLS_DIR']}/{name}.key"]
