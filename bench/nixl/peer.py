"""The serving side of the NIXL benchmark: a process holding registered memory for a peer to read.

Prints one JSON line (agent metadata and the serialized descriptors of each size), then waits
until its standard input closes.
"""

from __future__ import annotations

import base64
import json
import sys

import torch
from nixl._api import nixl_agent, nixl_agent_config


def main() -> None:
    sizes = [int(s) for s in sys.argv[1:]]
    agent = nixl_agent("bench-source", nixl_agent_config(backends=["UCX"]))
    buffer = torch.randint(0, 256, (max(sizes),), dtype=torch.uint8)
    registration = agent.register_memory(buffer)
    descs = {str(n): base64.b64encode(agent.get_serialized_descs(agent.get_xfer_descs(buffer[:n]))).decode()
             for n in sizes}
    print(json.dumps({"metadata": base64.b64encode(agent.get_agent_metadata()).decode(), "descs": descs}), flush=True)
    sys.stdin.read()
    agent.deregister_memory(registration)


if __name__ == "__main__":
    main()
