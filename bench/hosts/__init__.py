"""Many hosts on one machine: network namespaces, a mesh placed across them, and partition faults."""
