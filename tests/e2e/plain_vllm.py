"""A single plain vLLM (`vllm.LLM`, no kvmesh) with the settings a kvmesh vLLM worker gives its
engine: the reference the mesh's outputs are compared with.

    python -m tests.e2e.plain_vllm MODEL_DIR < cases.json > outputs.json

`cases.json`: `{"adapters": {NAME: PATH}, "max_tokens": N, "cases": [[prompt_token_ids, lora_name], ...]}`
(lora_name "" for the base model); the output: one `{"token_ids": [...], "text": "..."}` per case,
greedy, each case run on its own.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from services.engines.lora import LoraConfig
    from services.engines.model_facts import read_model_facts
    from services.engines.vllm_lora import lora_engine_args

    model = sys.argv[1]
    spec = json.load(sys.stdin)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    _, context, _ = read_model_facts(model)
    # As VllmEngine.start and the worker's defaults (--max-loras 4, --max-lora-rank 16) set them.
    llm = LLM(model=model, block_size=32, max_model_len=context, max_num_seqs=64, enable_prefix_caching=True,
              enforce_eager=True, **lora_engine_args(LoraConfig(enabled=True)))
    ids = {name: i for i, name in enumerate(sorted(spec["adapters"]), start=1)}
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True)
    out = []
    for tokens, lora in spec["cases"]:
        request = LoRARequest(lora, ids[lora], spec["adapters"][lora]) if lora else None
        (result,) = llm.generate([{"prompt_token_ids": tokens}], params, lora_request=request, use_tqdm=False)
        out.append({"token_ids": list(result.outputs[0].token_ids), "text": result.outputs[0].text})
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
