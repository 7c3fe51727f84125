"""The etcd keyspace, in one place. Every key is ``<prefix>/<area>/...``; the default prefix is /unicron.

=========================  ===========  ====================================================
key                        written by   value
=========================  ===========  ====================================================
nodes/<node>               agent        NodeInfo JSON, under the agent's lease
status/<node>              agent        NodeStatus JSON, under the agent's lease
reports/<node>/<id>        agent        Report JSON (no lease: survives the agent's death);
                                        deleted by the coordinator once recorded
incidents/<id>             coordinator  Incident JSON
leader                     coordinator  leader's address, under its lease (fencing guard)
coordinators/<link addr>   coordinator  every coordinator's address, leader or standby, under a
                                        lease of its own: where agents look for the leader while
                                        etcd is down (agent/link.py)
tasks/<task>               coordinator  TaskSpec JSON (the task set)
state                      coordinator  decision-core state JSON (survives restarts)
assign/<node>              coordinator  NodeAssignment JSON (desired state, with generation)
results/<node>             agent        AssignmentResult JSON (observed state)
stores/<task>              agent        StoreAddress JSON of the task's store sidecar, under the
                                        lease of the agent of the assignment's store_node (a
                                        newer store_epoch when the store moved off a lost node)
inject/<node>/<id>         CLI          fault-injection request for that node's agent
drain/<node>               CLI/API,     present while the node is drained: "1" by an operator,
                           coordinator  "goodbye" while its agent is away after a planned stop
=========================  ===========  ====================================================
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PREFIX = "/unicron"


@dataclass(frozen=True)
class Keyspace:
    prefix: str = DEFAULT_PREFIX

    def _k(self, *parts: str) -> str:
        return "/".join((self.prefix.rstrip("/"), *parts))

    def nodes(self) -> str:
        return self._k("nodes", "")

    def node(self, node: str) -> str:
        return self._k("nodes", node)

    def statuses(self) -> str:
        return self._k("status", "")

    def status(self, node: str) -> str:
        return self._k("status", node)

    def reports(self) -> str:
        return self._k("reports", "")

    def report(self, node: str, report_id: str) -> str:
        return self._k("reports", node, report_id)

    def incidents(self) -> str:
        return self._k("incidents", "")

    def incident(self, incident_id: str) -> str:
        return self._k("incidents", incident_id)

    def leader(self) -> str:
        return self._k("leader")

    def coordinators(self) -> str:
        return self._k("coordinators", "")

    def coordinator(self, link_address: str) -> str:
        return self._k("coordinators", link_address)

    def tasks(self) -> str:
        return self._k("tasks", "")

    def task(self, name: str) -> str:
        return self._k("tasks", name)

    def state(self) -> str:
        return self._k("state")

    def state_nodes(self) -> str:
        """The decision state's node entries, one record each (the ``state`` key holds the rest)."""
        return self._k("state", "nodes", "")

    def state_node(self, node: str) -> str:
        return self._k("state", "nodes", node)

    def state_tasks(self) -> str:
        return self._k("state", "tasks", "")

    def state_task(self, task: str) -> str:
        return self._k("state", "tasks", task)

    def assignments(self) -> str:
        return self._k("assign", "")

    def assignment(self, node: str) -> str:
        return self._k("assign", node)

    def results(self) -> str:
        return self._k("results", "")

    def result(self, node: str) -> str:
        return self._k("results", node)

    def stores(self) -> str:
        return self._k("stores", "")

    def store(self, task: str) -> str:
        return self._k("stores", task)

    def injections(self, node: str) -> str:
        return self._k("inject", node, "")

    def injection(self, node: str, inject_id: str) -> str:
        return self._k("inject", node, inject_id)

    def drains(self) -> str:
        return self._k("drain", "")

    def drain(self, node: str) -> str:
        return self._k("drain", node)

    def txns(self) -> str:
        """Staged chunks of leader writes too wide for one etcd transaction (coordinator.leader)."""
        return self._k("txn", "")

    def txn(self, txn_id: str) -> str:
        """The commit record of one wide write; its chunks are under ``txn/<id>/<i>``."""
        return self._k("txn", txn_id)

    def txn_chunk(self, txn_id: str, index: int) -> str:
        return self._k("txn", txn_id, f"{index:06d}")

    def tail(self, key: str, area_prefix: str) -> str:
        """The part of ``key`` after ``area_prefix`` (e.g. the node name of a nodes/ key)."""
        return key[len(area_prefix):]
