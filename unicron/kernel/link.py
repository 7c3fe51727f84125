"""Messages on the agent <-> coordinator link (one TCP connection per agent, one JSON line each).

Agent -> coordinator: ``LinkHello`` first, then a ``Heartbeat`` every ``heartbeat_s``, and ``Goodbye``
before a planned stop. Coordinator -> agent: ``Welcome`` once the hello is accepted; the coordinator
closes the connection instead when it refuses the hello, and after it has taken a goodbye.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from unicron.kernel.errors import InvalidRecord
from unicron.kernel.protocol import Message


@dataclass(frozen=True)
class LinkHello(Message):
    TYPE: ClassVar[str] = "hello"
    node: str
    #: ``NodeInfo.link_token`` of the agent's registration: until the link has TLS (issue 17), only
    #: the agent that wrote ``nodes/<node>`` knows it, so a stranger cannot speak for the node.
    token: str = ""

    def __post_init__(self) -> None:
        if not self.node:
            raise InvalidRecord("LinkHello.node: empty node name")
        for name, value in (("node", self.node), ("token", self.token)):
            # JSON's "\ud800" is a lone surrogate: it has no UTF-8 form, and encoding it (the token's
            # compare, the node's etcd key) raised UnicodeEncodeError on the link's connection thread
            try:
                value.encode()
            except UnicodeEncodeError:
                raise InvalidRecord(f"LinkHello.{name}: not UTF-8 text (a lone surrogate)") from None


@dataclass(frozen=True)
class Welcome(Message):
    TYPE: ClassVar[str] = "welcome"


@dataclass(frozen=True)
class Heartbeat(Message):
    TYPE: ClassVar[str] = "hb"
    ts: float = field(default_factory=time.time)


@dataclass(frozen=True)
class Goodbye(Message):
    """The agent stops on purpose (``systemctl stop``): its node is leaving, not failing."""

    TYPE: ClassVar[str] = "goodbye"
    reason: str = ""


LinkMessage = LinkHello | Welcome | Heartbeat | Goodbye

LINK_TYPES: dict[str, type[LinkMessage]] = {cls.TYPE: cls for cls in (LinkHello, Welcome, Heartbeat, Goodbye)}


def parse(obj: dict[str, Any]) -> LinkMessage:
    body = dict(obj)
    tag = body.pop("type", None)
    cls = LINK_TYPES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise InvalidRecord(f"unknown link message type {tag!r}; expected one of {sorted(LINK_TYPES)}")
    return cls.from_dict(body)
