"""The project-wide exception hierarchy.

``TemporaryError`` means "retry later, nothing is lost" (etcd unreachable, a peer down);
``PermanentError`` means "this input or state is wrong; retrying will not help" (kopf's split).
Errors from third-party clients are converted at the boundary with ``raise ... from exc``.
"""


class UnicronError(Exception):
    """Base of every error this project raises on purpose."""


class TemporaryError(UnicronError):
    """A condition expected to clear by itself; callers retry with backoff."""


class PermanentError(UnicronError):
    """A condition that retrying will not fix; callers report it and move on."""


class InvalidRecord(PermanentError):
    """A JSON record (etcd value, socket message, spec file) is malformed. The message names the field."""


class ConfigError(PermanentError):
    """A setting has a bad value; the message names the flag and its environment variable."""


class StartFailed(PermanentError):
    """A process started here (etcd, a daemon of a local cluster, a fleet process) exited or never became
    ready: the message names it, its exit status and where its log is."""


class StoreUnavailable(TemporaryError):
    """etcd could not be reached (all endpoints down or timing out, no leader, too many requests)."""


class LeaseLost(StoreUnavailable):
    """A write named a lease etcd no longer has; temporary because the owner re-registers under a new one."""


class StoreRejected(PermanentError):
    """etcd answered and refused the request (too large, bad argument, compacted revision): retrying the
    same request cannot succeed."""


class StoreClosed(PermanentError):
    """The client was used after :meth:`Store.close`: a shutdown race or a bug, never an outage."""


class NotLeader(PermanentError):
    """A guarded write was rejected: this coordinator no longer holds the leadership key."""
