"""The agreed membership of one process-group epoch, as stored under ``epoch/<epoch>`` (no torch
import: launchers and tests read these records too)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from unicron.kernel.errors import InvalidRecord


@dataclass(frozen=True)
class EpochRecord:
    """The agreed membership of one epoch, as stored under ``epoch/<epoch>``."""

    epoch: int
    #: global ranks of the epoch, ascending (complete replicas only)
    members: tuple[int, ...]
    #: incarnation of each member's process (see :mod:`unicron.runtime.store`)
    incarnations: dict[int, int]
    #: why the epoch was formed (start, failure, reattempt, admission)
    reason: str = ""

    def encode(self) -> str:
        return json.dumps(
            {"epoch": self.epoch, "members": list(self.members),
             "incarnations": {str(k): v for k, v in self.incarnations.items()}, "reason": self.reason},
            sort_keys=True,
        )

    @classmethod
    def decode(cls, raw: bytes | str) -> EpochRecord:
        try:
            obj = json.loads(raw)
            return cls(
                epoch=int(obj["epoch"]), members=tuple(int(m) for m in obj["members"]),
                incarnations={int(k): int(v) for k, v in obj["incarnations"].items()},
                reason=str(obj.get("reason", "")),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidRecord(f"epoch record: {exc}: {raw!r:.200}") from exc
