"""The runtime fences an overlapping snapshot before it steps (``Checkpointer.fence``): with
``UNICRON_CKPT_OVERLAP`` a snapshot's tensors are copied in the background while the next
forward/backward runs, and only the fence keeps the optimizer step from changing them under the copy."""

from __future__ import annotations

from pathlib import Path

from tests.runtime.conftest import Runner, train_args
from tests.runtime.test_preempt import memory_args, persisted

#: a rank whose background copies each take 0.3 s: much longer than an iteration of the small model
SLOW_COPY = """
import sys, time
from ckpt import codec

copy_into = codec.copy_into

def slow_copy_into(*args, **kwargs):
    time.sleep(0.3)
    return copy_into(*args, **kwargs)

codec.copy_into = slow_copy_into
from unicron.runtime.train import main
sys.exit(main())
"""


def test_an_overlapping_snapshot_is_fenced_before_the_step(runner: Runner, tmp_path: Path) -> None:
    """A checkpoint every iteration, each copy slower than an iteration: every snapshot is published
    and persisted whole. Without the fence each was torn by the next step and discarded."""
    script = tmp_path / "slow_copy.py"
    script.write_text(SLOW_COPY)
    ck = tmp_path / "ck"
    iterations = 5
    done = runner.run(1, train_args(iterations, "float32", False, *memory_args(ck, every=1)),
                      env={0: {"UNICRON_CKPT_OVERLAP": "1", "UNICRON_CKPT_KEEP_REMOTE": "10"}}, script=str(script))
    assert done.codes == {0: 0}, done.job.logs()
    assert [e["it"] for e in done.events(0, "checkpoint")] == list(range(1, iterations + 1))
    assert persisted(ck) == list(range(1, iterations + 1)), done.job.logs()
