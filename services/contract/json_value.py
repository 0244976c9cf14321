"""A JSON value on the wire (`JsonValue`, protos/kvmesh/v1/json_value.proto) and back, unchanged.

What Python's `json` reads is what comes back: the same key order, an int still an int (past
int64 too) and a float still a float (2.0, -0.0, inf), so the chat template renders, and
structured output enforces, exactly what the client sent. Both directions walk the value with a
stack of their own, never recursion: a request may nest as deep as its body may (about a
thousand levels).
"""

from __future__ import annotations

from typing import Any

from google.protobuf import struct_pb2

from gen.kvmesh.v1 import json_value_pb2

_INT64 = range(-(2**63), 2**63)


def to_json_value(value: Any) -> json_value_pb2.JsonValue:
    """`value` (dicts, lists, str, int, float, bool and None, as `json.loads` gives them) as nodes.
    A string no UTF-8 wire can carry (a lone surrogate, which JSON may escape) raises
    UnicodeEncodeError."""
    out = json_value_pb2.JsonValue()
    nodes = out.nodes
    # What is still to write, the next one last: (its key in the enclosing object, if any; value).
    pending: list[tuple[str | None, Any]] = [(None, value)]
    while pending:
        key, item = pending.pop()
        node = nodes.add()
        if key is not None:
            node.key = key
        if isinstance(item, dict):
            node.object_size = len(item)
            pending.extend(reversed(item.items()))
        elif isinstance(item, (list, tuple)):  # a tuple is an array, as json.dumps writes it
            node.array_size = len(item)
            pending.extend((None, v) for v in reversed(item))
        elif isinstance(item, str):
            node.string_value = item
        elif item is None:
            node.null_value = struct_pb2.NULL_VALUE
        elif isinstance(item, bool):  # before int: a bool is one
            node.bool_value = item
        elif isinstance(item, int):
            if item in _INT64:
                node.integer_value = item
            else:
                node.big_integer_value = str(item)
        elif isinstance(item, float):
            node.number_value = item
        else:
            raise TypeError(f"not a JSON value: {type(item).__name__}")
    return out


def from_json_value(value: json_value_pb2.JsonValue) -> Any:
    """The value `to_json_value` was given. ValueError for nodes that are not one whole value."""
    root: list[Any] = []
    # The arrays and objects still open, innermost last, and how many items each still expects.
    open_: list[list[Any] | dict[str, Any]] = [root]
    expected = [1]
    for node in value.nodes:
        if not expected:
            raise ValueError("nodes past the end of the value")
        kind = node.WhichOneof("kind")
        item: Any
        size = 0
        if kind == "string_value":
            item = node.string_value
        elif kind == "object_size":
            item, size = {}, node.object_size
        elif kind == "array_size":
            item, size = [], node.array_size
        elif kind == "integer_value":
            item = node.integer_value
        elif kind == "number_value":
            item = node.number_value
        elif kind == "bool_value":
            item = node.bool_value
        elif kind == "null_value":
            item = None
        elif kind == "big_integer_value":
            item = int(node.big_integer_value)
        else:
            raise ValueError("a node with no value")
        parent = open_[-1]
        if isinstance(parent, dict):
            parent[node.key] = item
        else:
            parent.append(item)
        expected[-1] -= 1
        if size:
            open_.append(item)
            expected.append(size)
        while expected and expected[-1] == 0:
            open_.pop()
            expected.pop()
    if expected:
        raise ValueError("the value ends early")
    return root[0]
