"""The KV cache protocol every part of the mesh speaks: how a block is hashed, which tier holds
it, and the events an engine emits when its cache changes. A leaf: it imports nothing else of
kvmesh, so engines, workers, the router and the mesh plumbing all build on it alike."""
