"""An engine's KV pull parameters (`PrefillResult.kv_pull`, a JSON object the engine defines) on
the wire (worker.proto's `KvPull`): a JsonValue, so integers stay exact (a 64-bit checksum, block
ids used as indexes) and the decode engine gets what the prefill engine gave."""

from __future__ import annotations

from typing import Any

from gen.kvmesh.v1 import worker_pb2
from services.contract.json_value import from_json_value, to_json_value


def kv_pull_to_proto(params: dict[str, Any]) -> worker_pb2.KvPull:
    return worker_pb2.KvPull(params=to_json_value(params))


def kv_pull_from_proto(pull: worker_pb2.KvPull) -> dict[str, Any]:
    params = from_json_value(pull.params)
    if not isinstance(params, dict):
        raise ValueError(f"KV pull parameters are a JSON object, not {type(params).__name__}")
    return params
