from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JsonValue(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[JsonNode]
    def __init__(self, nodes: _Optional[_Iterable[_Union[JsonNode, _Mapping]]] = ...) -> None: ...

class JsonNode(_message.Message):
    __slots__ = ("key", "null_value", "bool_value", "integer_value", "big_integer_value", "number_value", "string_value", "array_size", "object_size")
    KEY_FIELD_NUMBER: _ClassVar[int]
    NULL_VALUE_FIELD_NUMBER: _ClassVar[int]
    BOOL_VALUE_FIELD_NUMBER: _ClassVar[int]
    INTEGER_VALUE_FIELD_NUMBER: _ClassVar[int]
    BIG_INTEGER_VALUE_FIELD_NUMBER: _ClassVar[int]
    NUMBER_VALUE_FIELD_NUMBER: _ClassVar[int]
    STRING_VALUE_FIELD_NUMBER: _ClassVar[int]
    ARRAY_SIZE_FIELD_NUMBER: _ClassVar[int]
    OBJECT_SIZE_FIELD_NUMBER: _ClassVar[int]
    key: str
    null_value: _struct_pb2.NullValue
    bool_value: bool
    integer_value: int
    big_integer_value: str
    number_value: float
    string_value: str
    array_size: int
    object_size: int
    def __init__(self, key: _Optional[str] = ..., null_value: _Optional[_Union[_struct_pb2.NullValue, str]] = ..., bool_value: _Optional[bool] = ..., integer_value: _Optional[int] = ..., big_integer_value: _Optional[str] = ..., number_value: _Optional[float] = ..., string_value: _Optional[str] = ..., array_size: _Optional[int] = ..., object_size: _Optional[int] = ...) -> None: ...
