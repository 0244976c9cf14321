"""What a mocker worker's load reports say of its host tier and of what a prompt token costs."""

from __future__ import annotations

from services.engines.base import HostTierLoad, PrefillCost
from services.engines.mocker.block_manager import BlockManager
from services.engines.mocker.config import MockerConfig
from services.engines.mocker.timing import TimingModel


def host_tier_load(config: MockerConfig, blocks: BlockManager) -> HostTierLoad | None:
    """Its host-memory KV tier (None: it has none)."""
    if not config.host_kv_blocks:
        return None
    return HostTierLoad(blocks.host_active_blocks, config.host_kv_blocks, config.host_kv_gbps,
                        config.kv_bytes_per_token, blocks.host_hit_blocks)


def prefill_cost(timing: TimingModel) -> PrefillCost:
    """What a prompt token costs on the machine the timing model imitates. `speedup` divides
    compute and host-tier transfers alike, so it is left out: the router weighs the two against
    each other, and that ratio is the imitated machine's whatever the speedup."""
    return PrefillCost(timing.prefill_per_token_us, timing.prefill_us_per_token_per_1k())
