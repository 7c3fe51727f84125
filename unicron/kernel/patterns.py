"""Error text -> Table 1 error status.

One ordered table serves both the agent's stderr matcher (uninstrumented programs) and the
classification of exception reports whose rank did not name a kind. Specific patterns come first:
"CUDA error: an illegal memory access" is an illegal memory access, not a generic CUDA error.

A hardware kind is sev1 (the node is isolated), and a rank's stderr also carries its informational
logging (Python's ``logging`` writes there by default): a pattern names the fault, not the subsystem.
"ECC enabled, volatile uncorrected ECC errors: 0", "18 NVLink links active", "gpu driver 535 is older
than recommended" and "NCCL timeout set to 1800 s" once isolated healthy nodes.
"""

from __future__ import annotations

import re

import re2

from unicron.kernel.errors import ConfigError
from unicron.kernel.types import ErrorKind

PATTERNS: tuple[tuple[re.Pattern[str], ErrorKind], ...] = tuple(
    (re.compile(rx, re.IGNORECASE), kind)
    for rx, kind in (
        (r"illegal memory access|cudaErrorIllegalAddress", ErrorKind.ILLEGAL_MEMORY_ACCESS),
        # "ECC error(s)" but not a count of none ("uncorrected ECC errors: 0")
        (r"\bECC errors?\b(?!\s*[:=]\s*0\b)|uncorrectable ecc|double[- ]bit ecc|\bECC\b.{0,30}\b(fault|failure)\b",
         ErrorKind.ECC_ERROR),
        (r"invalid dma mapping|dma mapping error|iommu fault", ErrorKind.INVALID_DMA_MAPPING),
        (r"nvlink.{0,40}\b(errors?\b(?!\s*[:=]\s*0\b)|fail(ed|ure)?\b|fault|fatal|down\b|inactive)", ErrorKind.NVLINK_ERROR),
        (
            r"fallen off the bus|gpu driver.{0,40}\b(error|fail(ed|ure)?|crash(ed)?)\b|driver shutting down|NVRM: "
            r"|cudaErrorDevicesUnavailable"
            r"|CUDA driver version is insufficient|no CUDA-capable device",
            ErrorKind.GPU_DRIVER_ERROR,
        ),
        (
            r"Watchdog caught collective operation timeout|NCCL.{0,40}timed ?out|collective operation timeout"
            r"|NCCL timeout in:|reason for failure was:.{0,60}\btimeout\b"  # torch's C10D_NCCL_CHECK_TIMEOUT
            r"|NCCL.{0,40}timeout.{0,30}\b(error|exceeded|expired|reached)\b",
            ErrorKind.NCCL_TIMEOUT,
        ),
        (r"CUDA error|cudaError|CUBLAS_STATUS_|CUDNN_STATUS_|device-side assert", ErrorKind.CUDA_ERROR),
        (r"link flap|link (is )?down|port state change", ErrorKind.LINK_FLAPPING),
        (
            r"connection refused|connection reset|ECONNREFUSED|ECONNRESET|connection closed by peer"
            r"|Connection(Reset|Refused|Aborted)Error",
            ErrorKind.CONNECTION_REFUSED_RESET,
        ),
        (
            r"NCCL error|ncclSystemError|ncclInternalError|ncclRemoteError|broken pipe|network is unreachable"
            r"|no route to host|gloo.{0,40}(timeout|timed out|error)",
            ErrorKind.OTHER_NETWORK_ERROR,
        ),
    )
)


#: a count of none ("0 uncorrected ECC errors", "no ECC errors found", "errors: 0"): a health summary
NONE_COUNTED = re.compile(r"\b(0|no|zero)\s+(\w+\s+){0,3}errors?\b|\berrors?\s*[:=]\s*0\b", re.IGNORECASE)
#: the kinds a health summary names without a fault
_COUNTED = frozenset({ErrorKind.ECC_ERROR, ErrorKind.NVLINK_ERROR})


def match(text: str) -> ErrorKind | None:
    """The Table 1 status named by ``text``, or None when no known pattern occurs in it."""
    for rx, kind in PATTERNS:
        if rx.search(text):
            if kind in _COUNTED and NONE_COUNTED.search(text):
                continue  # "18 NVLink links active, 0 errors" reports health, not a fault
            return kind
    return None


def classify_text(text: str) -> ErrorKind:
    """Like :func:`match`, but unknown text is an "other software error" (Table 1's catch-all)."""
    return match(text) or ErrorKind.OTHER_SOFTWARE_ERROR


# --- a job's own output formats (the task's env; the agent reads the job's lines with them) ---------

#: lines that close an iteration (logging interval): a named group ``iteration``, optionally
#: ``elapsed_ms`` or ``elapsed_s``
ENV_PROGRESS_REGEX = "UNICRON_PROGRESS_REGEX"
#: lines that begin a checkpoint save (the hang clock pauses); an ``iteration`` group is optional
ENV_SAVE_START_REGEX = "UNICRON_SAVE_START_REGEX"
#: lines that end a save; without one, the next progress line of a later iteration ends it
ENV_SAVE_END_REGEX = "UNICRON_SAVE_END_REGEX"
#: each job-format variable, and whether its regex needs an ``iteration`` group
JOB_REGEXES: dict[str, bool] = {ENV_PROGRESS_REGEX: True, ENV_SAVE_START_REGEX: False, ENV_SAVE_END_REGEX: False}


#: a line is matched on its first characters only: a progress or save line is a few hundred long, and
#: a longer one (a dumped tensor, a progress bar) is neither
MAX_MATCHED_CHARS = 4096

_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False  # a refused pattern is our ConfigError, not a line on stderr


class JobRegex:
    r"""A regex of a job's output format (its own progress or save lines, or Megatron-LM's), matched in
    linear time (RE2) on at most :data:`MAX_MATCHED_CHARS` of a line. The agent matches every output
    line on its reader threads, and Python's backtracking ``re`` holds the GIL for the whole match:
    one job's regex (``(a+)+$``, or just ``.*step (?P<iteration>\d+)`` on a 64 KiB line) stalled the
    agent's heartbeat for seconds, the node was isolated, and the task moved on to stall the next
    node. RE2 takes Python's syntax without backreferences and lookaround. Raises ``re2.error``."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self._rx = re2.compile(pattern, options=_RE2_OPTIONS)
        self.names: frozenset[str] = frozenset(self._rx.groupindex)

    def matches(self, line: str) -> bool:
        return self._rx.search(line[:MAX_MATCHED_CHARS]) is not None

    def search(self, line: str) -> dict[str, str | None] | None:
        """The named groups of the first match in ``line`` (None when a group took no part; {} when the
        regex names none), or None when it does not match."""
        m = self._rx.search(line[:MAX_MATCHED_CHARS])
        if m is None:
            return None
        groups: dict[str, str | None] = m.groupdict()
        return groups


def _brief(pattern: str) -> str:
    """``pattern`` as an error shows it: repr, cut to a line's length (a nesting error's can be 6,000 characters)."""
    return repr(pattern) if len(pattern) <= 80 else f"{pattern[:60]!r}... ({len(pattern)} characters)"


def compile_job_regex(name: str, pattern: str) -> JobRegex:
    """The regex a job-format variable ``name`` holds; ConfigError (one line: the variable, the
    pattern, what is wrong) unless RE2 compiles it and it has the groups the variable needs."""
    try:
        rx = JobRegex(pattern)
    except (re2.error, ValueError, OverflowError, RecursionError) as exc:
        why = exc.args[0].decode(errors="replace") if exc.args and isinstance(exc.args[0], bytes) else str(exc)
        raise ConfigError(f"{name}: {_brief(pattern)} is not a regular expression RE2 accepts ({why}); job regexes "
                          "are matched in linear time: Python's syntax without backreferences or lookaround") \
            from exc
    if JOB_REGEXES.get(name, False) and "iteration" not in rx.names:
        raise ConfigError(f"{name}: {_brief(pattern)} has no (?P<iteration>...) group")
    return rx
