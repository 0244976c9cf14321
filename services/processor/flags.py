"""The processor's flags, declared once for the processor and the launcher."""

from __future__ import annotations

import argparse

from services.mesh.flags import non_negative_int, positive_float, positive_int
from services.processor.service import ProcessorConfig

ROUTING = ("service", "local")


def add_processor_flags(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Returns the group, so the launcher can hand the same values to its processors."""
    g = parser.add_argument_group("processor")
    g.add_argument("--request-timeout", type=positive_float, default=ProcessorConfig.request_timeout_s,
                   help="seconds one generation may take, however often it moves between workers")
    g.add_argument("--migration-limit", type=non_negative_int, default=ProcessorConfig.migration_limit,
                   help="times a request may move to another decode worker after its first token (0 = off)")
    g.add_argument("--default-max-tokens", type=positive_int, default=ProcessorConfig.default_max_tokens,
                   help="max_tokens of a request that sets none (the context's room left, if less)")
    g.add_argument("--routing", choices=ROUTING, default="service",
                   help="service: ask the kv-router service (one router sees every processor's dispatches); "
                        "local: keep the decode pool's index in this process and route without a hop "
                        "(the routing flags apply)")
    g.add_argument("--tool-call-parser", default=None,
                   help="vLLM tool-call parser that reads tool calls from the model's text for tool_choice auto "
                        "(hermes, llama3_json, mistral, qwen3_xml, ...; default: none, the text stays content)")
    g.add_argument("--reasoning-parser", default=None,
                   help="vLLM reasoning parser that splits the model's reasoning into reasoning_content "
                        "(deepseek_r1, qwen3, granite, ...; default: none)")
    return g
