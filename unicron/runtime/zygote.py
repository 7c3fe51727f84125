"""A pre-imported parent that forks rank processes: torch + Megatron imported once, not per rank.

Importing torch and Megatron-core costs seconds of CPU per process; a test suite that launches dozens
of short-lived 4-rank jobs on two cores would spend most of its budget importing. The zygote imports
:mod:`unicron.runtime.train` once and ``fork()``s each rank from that state (no threads exist yet, so
forking is safe); each child then runs exactly what ``python -m unicron.runtime.train`` runs, with its
own environment, log file and process id, and dies or is killed like any process.

Protocol: JSON lines. Launcher -> zygote: ``{"op": "spawn", "id", "argv", "env", "log"}`` and
``{"op": "quit"}``. Zygote -> launcher: ``{"op": "spawned", "id", "pid"}`` and
``{"op": "exit", "pid", "code"}`` (``code`` negative for a signal, like ``Popen.returncode``).
Only :class:`unicron.runtime.launch.LocalJob` uses it; the agent execs ranks normally.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import sys
from typing import Any


def _child(msg: dict[str, Any]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    fd = os.open(msg["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.environ.clear()
    os.environ.update(msg["env"])
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    module = importlib.import_module(msg.get("module", "unicron.runtime.train"))  # imported already
    code = 1
    try:
        code = module.main(msg["argv"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _reap(out: Any) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        out.write(json.dumps({"op": "exit", "pid": pid, "code": code}) + "\n")
        out.flush()


def main() -> int:
    for name in sys.argv[1:] or ["unicron.runtime.train"]:
        importlib.import_module(name)  # the whole point: import once, fork many

    inp, out = sys.stdin, sys.stdout
    out.write(json.dumps({"op": "ready", "pid": os.getpid()}) + "\n")
    out.flush()
    buf = ""
    while True:
        ready, _, _ = select.select([inp], [], [], 0.005)
        _reap(out)
        if not ready:
            continue
        chunk = os.read(inp.fileno(), 65536).decode()
        if not chunk:
            return 0
        buf += chunk
        while "\n" in buf:
            line, buf = buf.split("\n", 1)
            msg = json.loads(line)
            if msg["op"] == "quit":
                return 0
            if msg["op"] == "spawn":
                pid = os.fork()
                if pid == 0:
                    _child(msg)
                out.write(json.dumps({"op": "spawned", "id": msg["id"], "pid": pid}) + "\n")
                out.flush()


if __name__ == "__main__":
    sys.exit(main())
