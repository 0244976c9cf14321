"""What agent clients send beside the prompt, and what the gateway does with each field.

Claude Code and Codex send fields the textbook calls never do (session ids, cache hints, effort
levels, beta features). Refusing them stops the client on its first request; dropping them without
a word hides from the operator what the mesh did not honour. So every top-level field of the
Messages and Responses APIs has a stated effect here (docs/reference.md, "What agent clients
send", says the same in words): IMPLEMENTED ones change the answer or the routing;
ACCEPTED ones are taken without effect, each counted by name
(`kvmesh_frontend_client_fields_total{api,field,effect}`) so an operator sees what was not
honoured. A field in neither table is counted as `unknown` under its own name (bounded: after
MAX_NAMED distinct unknown names, `other`), which is how a client update that sends something
new shows up.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable

from prometheus_client import Counter

from services.frontend.responses_input import HOSTED_TOOLS


class Effect(enum.Enum):
    IMPLEMENTED = "implemented"
    ACCEPTED = "accepted"  # taken without effect on the answer (reference: why)
    UNKNOWN = "unknown"  # in no table: accepted, ignored, counted by name


# Fields the Messages API reads (messages_schemas.py, messages_api.py, context_edits.py).
MESSAGES_IMPLEMENTED = frozenset({
    "model", "messages", "system", "max_tokens", "stream", "temperature", "top_p", "top_k", "stop_sequences",
    "tools", "tool_choice", "thinking", "output_config", "output_format", "metadata", "context_management",
    "service_tier", "priority", "seed",
})
# Taken and not honoured, with the reason the reference gives.
MESSAGES_ACCEPTED = {
    "cache_control": "every prefix is cached without breakpoints",
    "betas": "beta features are served or refused by the fields they add, not by name",
}
RESPONSES_IMPLEMENTED = frozenset({
    "model", "input", "instructions", "max_output_tokens", "stream", "temperature", "top_p", "top_k", "seed",
    "tools", "tool_choice", "parallel_tool_calls", "text", "reasoning", "include", "store", "prompt_cache_key",
    "user", "metadata", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "logit_bias",
    "stop", "structured_outputs", "chat_template_kwargs", "priority",
})
RESPONSES_ACCEPTED = {
    "client_metadata": "the client's own telemetry ids: nothing the model reads",
    "service_tier": "one tier is served",
    "truncation": "a prompt past the context is refused, never truncated",
    "safety_identifier": "no per-user policy is applied",
    "prompt_cache_retention": "prefixes stay cached while the workers' memory holds them",
    "top_logprobs": "the Responses API answers no logprobs",
    "stream_options": "streams carry usage in their last event",
}
# Parts of a request that are accepted without effect below the top level, named as a path.
NESTED_ACCEPTED = {
    "messages": {
        "thinking.display": "`summarized`: thinking is returned as generated, never summarized",
        "tools.eager_input_streaming": "tool input always streams as it is generated",
        "output_config.effort.xhigh": "the template knows effort up to high: xhigh and max are high",
    },
    "responses": {
        "reasoning.summary": "no reasoning summaries are written: reasoning is returned whole",
        **{f"tools.{kind}": "hosted tools are not offered to the model: the mesh runs none" for kind in HOSTED_TOOLS},
    },
}
TABLES = {"messages": (MESSAGES_IMPLEMENTED, MESSAGES_ACCEPTED), "responses": (RESPONSES_IMPLEMENTED, RESPONSES_ACCEPTED)}
# Distinct unknown names counted by name; past that they are `other` (a client cannot grow the
# metric without bound).
MAX_NAMED = 64
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,48}$")


def effect_of(api: str, field: str) -> Effect:
    implemented, accepted = TABLES[api]
    if field in implemented:
        return Effect.IMPLEMENTED
    if field in accepted or field in NESTED_ACCEPTED.get(api, {}):
        return Effect.ACCEPTED
    return Effect.UNKNOWN


class ClientFields:
    """The counter of fields taken without effect, by API and name."""

    def __init__(self, counter: Counter) -> None:
        self._counter = counter
        self._named: set[str] = set()

    def note(self, api: str, body: dict, nested: Iterable[str] = ()) -> None:
        """Counts, once per request, each top-level field not implemented and each nested part
        the request's translation reported as accepted without effect."""
        implemented, _ = TABLES[api]
        for field in body:
            if field not in implemented:
                self._count(api, field, effect_of(api, field))
        for path in nested:
            self._count(api, path, Effect.ACCEPTED)

    def _count(self, api: str, field: str, effect: Effect) -> None:
        if effect is Effect.UNKNOWN and field not in self._named:
            if len(self._named) >= MAX_NAMED or not _NAME.match(field):
                field = "other"
            else:
                self._named.add(field)
        self._counter.labels(api, field, effect.value).inc()
