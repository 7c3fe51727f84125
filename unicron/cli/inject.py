"""``unicron inject``: the fault-injection harness.

``kill-node`` (SIGKILL the node's agent) and ``silence-node`` (SIGSTOP it; ``--resume`` sends
SIGCONT) act on the agent's process directly, so they work only on the machine the agent runs on
(the local demo, tests, benchmarks, or a shell on the node): refused elsewhere, and for a pid that no
longer names the registered agent. Every other fault is executed by the node's agent: the
request goes to ``inject/<node>/<id>`` in etcd and the agent writes back when it executed it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import time
from dataclasses import replace
from datetime import UTC, datetime

from unicron.cli.common import add_cluster_flags, at_least, open_store
from unicron.kernel import procs
from unicron.kernel.config import finite_float
from unicron.kernel.errors import InvalidRecord, PermanentError
from unicron.kernel.etcd import Store
from unicron.kernel.inject import MAX_SLOW_ITERATIONS, Fault, Injection, request
from unicron.kernel.keyspace import Keyspace
from unicron.kernel.protocol import MAX_SLOW_DELAY_S
from unicron.kernel.types import FAULT_KINDS, ErrorKind

AGENT_FAULTS = tuple(f.value for f in Fault)
LOCAL_FAULTS = ("kill-node", "silence-node")


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("inject", help="inject a fault (for tests, demos and drills)")
    add_cluster_flags(p)
    p.add_argument("fault", choices=LOCAL_FAULTS + AGENT_FAULTS)
    p.add_argument("arg", nargs="?", help="raise: the error kind (e.g. cuda_error); xid: the XID code (e.g. 79)")
    p.add_argument("--node", required=True, help="the node to inject on")
    p.add_argument("--task", help="the task (default: the node's first task)")
    p.add_argument("--rank", type=at_least(int, 0), help="the global rank (default: the node's first rank of the task)")
    p.add_argument("--gpu", type=at_least(int, 0), default=0, help="xid: the simulated GPU index (default 0)")
    # bounded here, where the operator can be told; a rank clamps a longer one
    p.add_argument("--delay", type=at_least(finite_float, 0.0, most=MAX_SLOW_DELAY_S), default=1.0,
                   help=f"slow: seconds added per iteration (default 1.0, at most {MAX_SLOW_DELAY_S:g})")
    p.add_argument("--iterations", type=at_least(int, 1, most=MAX_SLOW_ITERATIONS), default=1,
                   help=f"slow: how many iterations (default 1, at most {MAX_SLOW_ITERATIONS})")
    p.add_argument("--resume", action="store_true", help="silence-node: send SIGCONT instead (end the silence)")
    p.set_defaults(func=cmd_inject)


def _stamp(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds")


def node_record(store: Store, keys: Keyspace, node: str) -> bytes:
    """The node's registration; refused at once for an unknown node (its agent could never answer)."""
    kv = store.get(keys.node(node))
    if kv is None:
        raise PermanentError(f"node {node!r} is not registered (see 'unicron nodes')")
    return kv.value


def _record(store: Store, keys: Keyspace, node: str) -> dict[str, object]:
    try:
        record = json.loads(node_record(store, keys, node))
    except ValueError:  # UnicodeDecodeError included
        record = None
    if not isinstance(record, dict):
        raise InvalidRecord(f"node {node!r}: its registration is not a JSON object")
    return record


def agent_pid(record: dict[str, object], node: str) -> int:
    pid = record.get("agent_pid")
    # os.kill(0) signals the operator's own process group, -1 every process it may signal, 1 is init;
    # True is an int to isinstance
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 1:
        raise PermanentError(f"node {node!r} has no agent pid in its record (agent_pid {pid!r})")
    return pid


#: how much later than its registration's ``started_ts`` a process may seem to have started and still
#: be that agent (the boot time in /proc/stat is whole seconds, and follows the wall clock: a clock
#: stepped forward by more since the agent registered makes it refused, never another process signalled)
START_SLACK_S = 2.0


def _check_here(record: dict[str, object], node: str, pid: int) -> None:
    """Refuse unless ``pid`` on this machine is the agent that registered ``node``: the pid is the agent's
    host's, so run elsewhere the command signalled whatever local process had that number (etcd, the
    coordinator), and a dead agent's pid may since name another process."""
    host, here = record.get("hostname"), socket.gethostname()
    if host != here:
        raise PermanentError(f"node {node}'s agent runs on host {host or '(not recorded)'}, not on {here}; "
                             "run this command there")
    started, registered = procs.started_at(pid), record.get("started_ts")
    if started is None:
        raise PermanentError(f"agent pid {pid} of node {node} is not running on this machine; nothing signalled")
    if not isinstance(registered, int | float) or started > registered + START_SLACK_S:
        raise PermanentError(f"pid {pid} is no longer node {node}'s agent (it started after the agent "
                             "registered: the agent is dead); nothing signalled")


def signal_agent(store: Store, keys: Keyspace, node: str, sig: signal.Signals) -> tuple[int, float]:
    record = _record(store, keys, node)
    pid = agent_pid(record, node)
    _check_here(record, node, pid)
    try:
        os.kill(pid, sig)
    except ProcessLookupError as exc:
        raise PermanentError(f"agent pid {pid} of node {node} is not on this machine (or already dead)") from exc
    except PermissionError as exc:  # e.g. a root agent (systemd) and a non-root operator
        raise PermanentError(f"agent pid {pid} of node {node}: not permitted to signal it "
                             "(it runs as another user; run as that user or root)") from exc
    return pid, time.time()


def build_request(args: argparse.Namespace) -> Injection:
    fault = Fault(args.fault)
    req = Injection(fault=fault, task=args.task or None, rank=args.rank)
    if fault is Fault.RAISE:
        kinds = [k.value for k in FAULT_KINDS]
        if args.arg not in kinds:
            raise PermanentError(f"raise needs an error kind, one of: {', '.join(kinds)}")
        return replace(req, kind=ErrorKind(args.arg))
    if fault is Fault.XID:
        code = args.arg or ""
        # '²'.isdigit(), but int() refuses it; NVML's XID is an unsigned 64-bit value (20 digits at most)
        if not (code.isascii() and code.isdigit() and len(code) <= 20 and int(code) < 2**64):
            raise PermanentError("xid needs a numeric XID code below 2**64, e.g. 'unicron inject xid 79 --node n1'")
        return replace(req, code=int(args.arg), gpu=args.gpu)
    if fault is Fault.SLOW:
        return replace(req, delay_s=args.delay, iterations=args.iterations)
    return req


def cmd_inject(args: argparse.Namespace) -> int:
    req = None if args.fault in LOCAL_FAULTS else build_request(args)  # a bad request is refused before etcd is dialled
    store, keys = open_store(args)
    try:
        if req is None:
            sig = signal.SIGKILL if args.fault == "kill-node" else (signal.SIGCONT if args.resume else signal.SIGSTOP)
            pid, ts = signal_agent(store, keys, args.node, sig)
            print(f"{_stamp(ts)} {args.fault}: sent {sig.name} to agent pid {pid} of node {args.node}")
            return 0
        node_record(store, keys, args.node)
        answer = request(store, keys, args.node, req)
        stamp = _stamp(answer.executed_ts or 0.0)
        if not answer.ok:
            print(f"{stamp} {args.fault} on node {args.node} FAILED: {answer.detail}")
            return 1
        print(f"{stamp} {args.fault} on node {args.node}: {answer.detail}")
        return 0
    finally:
        store.close()
