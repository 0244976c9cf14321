"""vLLM's request and output types in the engine interface's terms: structured-output
constraints, the field a refusal names, finish reasons and logprobs."""

from __future__ import annotations

from typing import Any

from services.engines.base import FinishReason, Sampling, Structured, TokenLogprobs


def structured_outputs(spec: Structured) -> Any:
    from vllm.sampling_params import StructuredOutputsParams

    field = {"json": "json", "json_object": "json_object", "regex": "regex", "choice": "choice",
             "grammar": "grammar"}[spec.kind]
    value: Any = True if spec.kind == "json_object" else list(spec.value or ()) if spec.kind == "choice" else spec.value
    return StructuredOutputsParams(**{field: value})


def param_of(exc: Exception, sampling: Sampling) -> str:
    """The request field a vLLM refusal names, in the API's terms: a constraint error names
    the field the constraint came from."""
    param = str(getattr(exc, "parameter", None) or "")
    if sampling.structured is not None and ("structured" in param or "guided" in param or "grammar" in str(exc)):
        return sampling.structured.param
    return param


def finish_reason_of(reason: str | None) -> FinishReason:
    """vLLM's reason, where OpenAI has it; anything else (vLLM's "abort", an error) is an abort."""
    return FinishReason(reason) if reason in (FinishReason.STOP, FinishReason.LENGTH) else FinishReason.ABORT


def logprobs_of(completion: Any) -> list[TokenLogprobs] | None:
    if not completion.logprobs:
        return None
    result = []
    for token_id, entries in zip(completion.token_ids, completion.logprobs):
        chosen = entries.get(token_id)
        top = tuple(sorted(((t, float(lp.logprob)) for t, lp in entries.items()), key=lambda x: -x[1]))
        result.append(TokenLogprobs(token_id, float(chosen.logprob) if chosen else 0.0, top))
    return result
