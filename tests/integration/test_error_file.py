"""A failed rank's exception reaches its incident end to end: real etcd, a coordinator and an agent. The
job's ``main`` is decorated with torch's ``@record`` and raises; the agent set TORCHELASTIC_ERROR_FILE,
``record`` wrote the exception there, and the agent read it into the failure's report. Before, the
incident said only "rank 0 exited abnormally (exit code 1)", and the traceback was on the agent's stderr
alone, as "[rank 0] ...", naming no task."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from unicron.cli.main import main as cli
from unicron.cluster.localcluster import LocalCluster
from unicron.kernel.types import ErrorKind

SCRIPT = """\
import sys, time
from torch.distributed.elastic.multiprocessing.errors import record

@record
def main() -> None:
    print("step 0 ", flush=True)
    time.sleep(0.5)
    raise RuntimeError(sys.argv[1])

main()
"""
ERROR = "CUDA out of memory. Tried to allocate 20.00 GiB (GPU 0; 79.15 GiB total capacity)"


def test_a_record_decorated_mains_exception_is_in_its_incident(tmp_path: Path) -> None:
    script = tmp_path / "raiser.py"
    script.write_text(SCRIPT)
    with LocalCluster(agents=1, gpus_per_agent=1, extra_env={"UNICRON_STATUS_INTERVAL": "0.2"}) as c:
        os.environ["UNICRON_ETCD"] = c.etcd.endpoint
        try:
            spec = tmp_path / "oom.json"
            spec.write_text(json.dumps({"name": "oom", "command": [sys.executable, str(script), ERROR],
                                        "min_gpus": 1, "recovery": "restart"}))
            assert cli(["submit", str(spec)]) == 0
            inc = c.wait_for(lambda: next((i for i in c.incidents() if i.task == "oom"
                                           and i.kind is ErrorKind.EXITED_ABNORMALLY), None), 90,
                             "the rank's failure as an incident", poll_s=0.2)
            assert cli(["cancel", "oom"]) == 0
        finally:
            os.environ.pop("UNICRON_ETCD", None)
        assert inc.message.startswith(f"rank 0 exited abnormally (exit code 1): RuntimeError: {ERROR}"), inc.message
        logs = Path(c.run_dir, "logs", "oom")
        assert f"RuntimeError: {ERROR}" in (logs / "rank0.err").read_text()  # the traceback, in the task's log
        # the failed attempt's, kept (with at most the one after it: older launches' directories go)
        kept = sorted(logs.glob("gen*/attempt_*/rank0/error.json"))
        assert 1 <= len(kept) <= 2, kept
        record = json.loads(kept[0].read_text())
        assert record["message"]["message"] == f"RuntimeError: {ERROR}"
