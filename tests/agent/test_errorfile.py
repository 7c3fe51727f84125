"""torch's error file (TORCHELASTIC_ERROR_FILE): what the agent reads from it after a rank's failure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agent import errorfile


def write(tmp_path: Path, data: object) -> str:
    path = tmp_path / "error.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_torchs_own_record_format_is_one_line_of_type_and_text(tmp_path: Path) -> None:
    # what ErrorHandler.record_exception writes (torch 2.13, errors/error_handler.py)
    data = {"message": {"message": "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB\nGPU 0 has 80 GiB",
                        "extraInfo": {"py_callstack": "Traceback ...\n" * 50, "timestamp": "1700000000"}}}
    assert errorfile.summary(write(tmp_path, data)) == (
        "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB GPU 0 has 80 GiB")


def test_nested_and_string_messages(tmp_path: Path) -> None:
    # a parent's dump_error_file wraps the child's data (errorCode added), and the "new" string format
    nested = {"message": {"message": {"message": "ValueError: bad batch", "extraInfo": {}}, "errorCode": 1}}
    assert errorfile.summary(write(tmp_path, nested)) == "ValueError: bad batch"
    assert errorfile.summary(write(tmp_path, {"message": "KeyError: 'x'", "timestamp": 1})) == "KeyError: 'x'"


def test_a_long_message_is_bounded() -> None:
    text = "RuntimeError: " + "x" * 10_000
    line = errorfile._one_line(text)
    assert len(line) == errorfile.MAX_SUMMARY_CHARS and line.startswith("RuntimeError: xxx") and line.endswith("...")


def test_no_file_is_no_summary_and_no_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert errorfile.summary(str(tmp_path / "absent.json")) is None
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


@pytest.mark.parametrize("content", [
    b"", b"not json", b"\xff\xfe garbage", b"[1, 2, 3]", b'{"message": 5}', b'{"other": "x"}',
    b"[" * 100_000, b'{"message": "' + b"\\u12" + b'"}', b"1" * 5000,
])
def test_a_malformed_file_is_one_warning_and_no_summary(tmp_path: Path, content: bytes,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "error.json"
    path.write_bytes(content)
    assert errorfile.summary(str(path)) is None
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 1


def test_a_huge_file_is_read_only_in_part_and_its_leading_message_used(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    data = {"message": {"message": "RecursionError: maximum recursion depth exceeded",
                        "extraInfo": {"py_callstack": "  File x, line 1\n" * 1_000_000, "timestamp": "1"}}}
    path = write(tmp_path, data)
    assert Path(path).stat().st_size > 4 * errorfile.MAX_READ_BYTES
    assert errorfile.summary(path) == "RecursionError: maximum recursion depth exceeded"
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 1


def test_what_torchs_record_writes_is_read(tmp_path: Path) -> None:
    """The real thing: a ``@record``-decorated main that raises, under the variable the agent sets."""
    path = tmp_path / "attempt_0" / "rank0" / "error.json"
    path.parent.mkdir(parents=True)
    code = ("from torch.distributed.elastic.multiprocessing.errors import record\n"
            "@record\n"
            "def main():\n"
            "    raise RuntimeError('CUDA out of memory in rank 0')\n"
            "main()\n")
    proc = subprocess.run([sys.executable, "-c", code], env={errorfile.ENV_ERROR_FILE: str(path), "PATH": "/usr/bin"},
                          capture_output=True, timeout=120)
    assert proc.returncode == 1
    assert errorfile.summary(str(path)) == "RuntimeError: CUDA out of memory in rank 0"
