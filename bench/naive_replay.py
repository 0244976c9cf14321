"""The replay CLI over the naive reference index (sets per node, per-level work): the baseline."""

from __future__ import annotations

import sys

from services.kv_router.replay import main
from tests.radix_reference import ReferenceTree

if __name__ == "__main__":
    main(sys.argv[1:], index_factory=ReferenceTree)
