"""Shared fixtures: a real etcd per test (never a mock), torn down whatever happens."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from unicron.cluster.etcd_server import EtcdServer
from unicron.kernel import tls
from unicron.kernel.etcd import Store


def _has_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


INTEGRATION = Path(__file__).parent / "integration"


def _select_phase(config: pytest.Config, items: list[pytest.Item]) -> None:
    """scripts/test.sh runs the suite in two phases (``UNICRON_TEST_PHASE``): ``unit``, everything
    outside tests/integration, on two workers; then ``integration``, one test at a time. An
    environment variable rather than ``-m``, so that a ``-m`` the caller passes still applies."""
    phase = os.environ.get("UNICRON_TEST_PHASE")
    if phase not in ("unit", "integration"):
        return
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    for item in items:
        (keep if (INTEGRATION in item.path.parents) == (phase == "integration") else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _select_phase(config, items)
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none on this machine")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _root_log_handlers_restored() -> Iterator[None]:
    """A test that runs a main in-process under ``capsys`` (``train.main`` configures logging) leaves the
    root handler on a stream pytest closes after it; every later test's log lines were then lost to
    "I/O operation on closed file"."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture
def etcd_server() -> Iterator[EtcdServer]:
    server = EtcdServer().start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def store(etcd_server: EtcdServer) -> Iterator[Store]:
    s = Store(etcd_server.endpoint)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def prefix() -> str:
    return f"/unicron-test-{os.getpid()}"


#: the certificates of :func:`cert_dir`: (role, name)
CERTS = ((tls.Role.COORDINATOR, "coordinator"), (tls.Role.OPERATOR, "operator"), (tls.Role.NODE, "node1"),
         (tls.Role.NODE, "node2"), (tls.Role.ETCD, "etcd"), (tls.Role.ETCD, "root"))


def make_certs(directory: Path) -> Path:
    """A cluster CA with :data:`CERTS` issued, as ``unicron certs`` writes them."""
    tls.init_ca(directory)
    for role, name in CERTS:
        tls.issue(directory, role, name)
    return directory


@pytest.fixture(scope="session")
def cert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Real certificates of one cluster CA (session-wide: issuing is cheap but not free)."""
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="session")
def foreign_cert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same names, issued by another CA: what a stranger's certificates look like."""
    return make_certs(tmp_path_factory.mktemp("foreign-certs"))


@contextlib.contextmanager
def mounted_tmpfs(root: Path, size: str) -> Iterator[Path]:
    """``root`` (made here) as an empty tmpfs of ``size`` (mount's spelling: ``4m``), unmounted after;
    the test is skipped where it cannot mount one (not root)."""
    root.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(root)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs (needs root)")
    try:
        yield root
    finally:
        subprocess.run(["umount", "-l", str(root)], check=True)


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """An empty 4 MiB tmpfs (room for the test model's two snapshot slots): a disk that a test fills
    for a real ENOSPC (see :func:`fill`)."""
    with mounted_tmpfs(tmp_path / "tiny", "4m") as root:
        yield root


def fill(path: Path) -> None:
    """Write ``path`` until its filesystem is full (ENOSPC)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        while True:
            os.write(fd, b"x" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
    finally:
        os.close(fd)
