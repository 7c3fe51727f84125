"""The etcd keyspace, in one place. Every key is ``<prefix>/<area>/...``; the default prefix is /unicron.

Each key's writer, value and lifetime: docs/architecture.md, "etcd keyspace" (one table, kept there
only, so that it cannot disagree with a copy here).
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
