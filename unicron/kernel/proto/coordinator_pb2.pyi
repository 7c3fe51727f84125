from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class SubmitRequest(_message.Message):
    __slots__ = ("spec_json", "update")
    SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    UPDATE_FIELD_NUMBER: _ClassVar[int]
    spec_json: str
    update: bool
    def __init__(self, spec_json: _Optional[str] = ..., update: _Optional[bool] = ...) -> None: ...

class SubmitReply(_message.Message):
    __slots__ = ("task_json", "already_submitted")
    TASK_JSON_FIELD_NUMBER: _ClassVar[int]
    ALREADY_SUBMITTED_FIELD_NUMBER: _ClassVar[int]
    task_json: str
    already_submitted: bool
    def __init__(self, task_json: _Optional[str] = ..., already_submitted: _Optional[bool] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class CancelReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListTasksRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class TaskList(_message.Message):
    __slots__ = ("task_json",)
    TASK_JSON_FIELD_NUMBER: _ClassVar[int]
    task_json: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, task_json: _Optional[_Iterable[str]] = ...) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeList(_message.Message):
    __slots__ = ("node_json",)
    NODE_JSON_FIELD_NUMBER: _ClassVar[int]
    node_json: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node_json: _Optional[_Iterable[str]] = ...) -> None: ...

class NodeRequest(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: str
    def __init__(self, node: _Optional[str] = ...) -> None: ...

class NodeReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListIncidentsRequest(_message.Message):
    __slots__ = ("limit",)
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    limit: int
    def __init__(self, limit: _Optional[int] = ...) -> None: ...

class IncidentList(_message.Message):
    __slots__ = ("incident_json",)
    INCIDENT_JSON_FIELD_NUMBER: _ClassVar[int]
    incident_json: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, incident_json: _Optional[_Iterable[str]] = ...) -> None: ...
