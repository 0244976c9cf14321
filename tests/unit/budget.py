"""How much randomised search a property test does: all of it under `make test` (CI and before a
commit), a tenth under `make test-unit` (KVMESH_QUICK_PROPERTIES=1), the edit-test loop."""

from __future__ import annotations

import os

QUICK = os.environ.get("KVMESH_QUICK_PROPERTIES") == "1"


def examples(full: int) -> int:
    """The number of examples (or random steps) to run of the `full` a property test asks for."""
    return max(20, full // 10) if QUICK else full
