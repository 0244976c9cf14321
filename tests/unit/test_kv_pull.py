"""KV pull parameters on the wire (services/worker/kv_pull.py): the engine's JSON object, exactly."""

from __future__ import annotations

from gen.kvmesh.v1 import worker_pb2
from services.worker.kv_pull import kv_pull_from_proto, kv_pull_to_proto


def round_trip(params: dict) -> dict:
    wire = kv_pull_to_proto(params).SerializeToString()
    return kv_pull_from_proto(worker_pb2.KvPull.FromString(wire))


def test_pull_parameters_come_back_as_they_were_sent() -> None:
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [0, 7, 4095],
              "remote_engine_id": "e-1", "remote_host": "10.0.0.2", "remote_port": 5600, "tp_size": 1,
              "ratio": 0.25, "nothing": None, "nested": {"ids": [[1, 2], [3]]},
              # The mocker's 64-bit checksum: no double holds it exactly.
              "checksum": 2**64 - 59}
    back = round_trip(params)
    assert back == params and list(back) == list(params)
    # Integers stay integers (a block id used as an index must not become 7.0).
    assert all(type(i) is int for i in back["remote_block_ids"]) and type(back["checksum"]) is int
    assert type(back["ratio"]) is float and type(back["do_remote_prefill"]) is bool


def test_a_tuple_travels_as_an_array_as_json_would_write_it() -> None:
    assert round_trip({"remote_block_ids": (4, 5, 6)}) == {"remote_block_ids": [4, 5, 6]}
