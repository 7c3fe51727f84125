"""torch elastic's error file: where a rank's ``@record``-decorated main writes its uncaught exception.

torch 2.13's elastic agent (``torch/distributed/elastic/multiprocessing/api.py``, ``_get_log_dests``)
gives each worker ``TORCHELASTIC_ERROR_FILE=<log_dir>/<run_id>/attempt_<restart count>/<local
rank>/error.json``, a directory it empties at each attempt's start; ``@record``
(``errors/__init__.py``) writes the exception there through ``ErrorHandler.record_exception``
(``errors/error_handler.py``) and re-raises, and the agent reads the file of a failed worker. Unset,
``record`` writes nothing.

Here the file is ``<run_dir>/logs/<task>/gen<G>/attempt_<E>/rank<R>/error.json``: E is the launch's
``TORCHELASTIC_RESTART_COUNT``; the generation is in the path because an in-place task's restart epoch
starts again at 0 in a new generation, and the global rank because a task's log directory holds every
rank this node ran. Any file already there (a rank re-hosted at the same epochs, a task submitted again
under its old name) is removed before the launch: what the agent reads after an exit is the exiting
process's own. Once a rank is launched again, the directories of its launches before the previous one
are removed (:func:`prune`): the run dir is memory under systemd, and a restart loop added one per rank
and restart for as long as the task ran. The previous launch's file stays for the agent to read (its exit
may be handled just after the successor started) and for an operator; its summary is in the report.

When a rank exits abnormally the agent reads its file (:func:`summary`): torch's format is
``{"message": {"message": "<type>: <text>", "extraInfo": {"py_callstack": ..., "timestamp": ...}}}``
(``record_exception``), the inner object possibly wrapped again by a parent's ``dump_error_file``, or
``{"message": "<text>", "timestamp": ...}`` (what torch calls the new format). The message goes into the
failure's report as one bounded line. The file is the job's: a malformed or huge one is one warning, and
the report goes out without it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import Collection

from unicron.kernel import jsontext
from unicron.kernel import log as ulog
from unicron.kernel.errors import InvalidRecord
from unicron.kernel.types import TaskAssignment

log = ulog.get(__name__)

#: the variable ``ErrorHandler._get_error_file_path`` reads
ENV_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
#: torch's name for the file
FILE_NAME = "error.json"


def path_for(log_dir: str, a: TaskAssignment, rank: int) -> str:
    """The error file of ``rank``'s launch under ``a`` (``log_dir``: the task's ``logs/<task>``)."""
    return os.path.join(log_dir, f"gen{a.generation}", f"attempt_{a.restart_epoch}", f"rank{rank}", FILE_NAME)


def prepare(path: str) -> None:
    """Make the error file's directory and remove a stale file there (an earlier launch's). Raises OSError
    (the node's trouble: its disk), as making the rank's log directory does."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def prune(log_dir: str, rank: int, keep: Collection[str]) -> None:
    """Remove the directories of ``rank``'s launches under ``log_dir`` (``gen*/attempt_*/rank<R>``) but
    those of the error files in ``keep``, and the attempt and generation directories left empty. Never
    raises: what cannot be removed now is tried again at the rank's next launch."""
    kept = {os.path.normpath(os.path.dirname(p)) for p in keep}
    try:
        gens = [e.path for e in os.scandir(log_dir) if e.name.startswith("gen") and e.is_dir(follow_symlinks=False)]
    except OSError:
        return
    for gen in gens:
        try:
            attempts = [e.path for e in os.scandir(gen) if e.name.startswith("attempt_")
                        and e.is_dir(follow_symlinks=False)]
        except OSError:
            continue
        for attempt in attempts:
            rank_dir = os.path.join(attempt, f"rank{rank}")
            if os.path.normpath(rank_dir) in kept:
                continue
            try:
                shutil.rmtree(rank_dir)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("an earlier launch's error file directory not removed", path=rank_dir, error=str(exc))
                continue
            with contextlib.suppress(OSError):  # another rank's launch still there: not empty
                os.rmdir(attempt)
        with contextlib.suppress(OSError):
            os.rmdir(gen)


#: the most of a file that is read: a traceback of a few hundred frames is tens of KiB
MAX_READ_BYTES = 256 * 1024
#: the longest summary put into a report (one line: the exception's type and the start of its text)
MAX_SUMMARY_CHARS = 300
#: how many ``message`` objects deep the text is looked for (a parent's dump wraps the child's once)
MAX_NESTING = 8
#: the first string-valued "message" (torch writes it before the traceback): a file over the limit
#: cannot be parsed whole, but its message is at its start. Unambiguous, so linear in the text.
_LEADING_MESSAGE = re.compile(r'"message"\s*:\s*("(?:[^"\\]|\\.)*")')


def summary(path: str) -> str | None:
    """One line naming the exception in the error file at ``path`` (``RuntimeError: CUDA out of memory
    ...``, at most :data:`MAX_SUMMARY_CHARS`), or None when there is no file or none can be read from it.
    Never raises for what the file holds; a file that is not torch's format is one warning."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_READ_BYTES + 1)
    except FileNotFoundError:
        return None  # the rank did not use @record, or died before it could write
    except OSError as exc:
        log.warning("rank error file unreadable", path=path, error=str(exc))
        return None
    text: str | None = None
    if len(raw) > MAX_READ_BYTES:
        problem = f"larger than {MAX_READ_BYTES} bytes; its leading message is used"
    else:
        try:
            text = _message(jsontext.parse(raw, path), MAX_NESTING)
            problem = "" if text is not None else "no message in it"
        except InvalidRecord as exc:
            problem = str(exc)
    if text is None:
        text = _leading_message(raw[:MAX_READ_BYTES])
    if problem:
        log.warning("rank error file not in torch's format", path=path, problem=problem,
                    message_found=text is not None)
    return _one_line(text) if text else None


def _message(data: object, depth: int) -> str | None:
    """The innermost ``message`` string of torch's error data."""
    if depth <= 0 or not isinstance(data, dict):
        return None
    inner = data.get("message")
    return inner if isinstance(inner, str) else _message(inner, depth - 1)


def _leading_message(raw: bytes) -> str | None:
    found = _LEADING_MESSAGE.search(raw.decode("utf-8", errors="replace"))
    if found is None:
        return None
    try:
        text = json.loads(found.group(1))
    except ValueError:  # a bad escape in the literal
        return None
    return text if isinstance(text, str) else None


def _one_line(text: str) -> str:
    """``text`` with every run of whitespace (its newlines) one space, cut to :data:`MAX_SUMMARY_CHARS`."""
    line = " ".join(text[: MAX_SUMMARY_CHARS * 4].split())
    return line if len(line) <= MAX_SUMMARY_CHARS else line[: MAX_SUMMARY_CHARS - 3].rstrip() + "..."
