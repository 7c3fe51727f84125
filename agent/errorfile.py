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
process's own.
"""

from __future__ import annotations

import contextlib
import os

from unicron.kernel.types import TaskAssignment

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
