"""A single plain vLLM (`vllm.LLM`, no kvmesh) with the settings a kvmesh vLLM worker gives its
engine: the reference the mesh's outputs are compared with.

    python -m tests.e2e.plain_vllm MODEL_DIR < cases.json > outputs.json

`cases.json`: `{"adapters": {NAME: PATH}, "max_tokens": N, "cases": [[prompt_token_ids, lora_name], ...]}`
(lora_name "" for the base model), and for a vision-language model `"chats": [messages, ...]`
(OpenAI chat messages, images as data URLs: vLLM's own `LLM.chat` renders and widens them); the
output: one `{"token_ids": [...], "text": "..."}` per case, then per chat, greedy, each run on its own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

REFERENCE_TIMEOUT_S = 400


class PlainVllm:
    """A reference run in its own process (this module as a script), started at once, its
    outputs read when first needed. Bound to as many cores as each engine of a two-engine mesh
    has (services/engines/cpu_cores.py), so both compute with the same threads and neither
    starves the other."""

    def __init__(self, model: Path | str, spec: dict) -> None:
        from services.engines.cpu_cores import bind_env, core_shares, host_cores

        self._log = tempfile.NamedTemporaryFile(prefix="kvmesh-plain-vllm-", suffix=".log", delete=False)
        env = {**os.environ, **bind_env(core_shares(host_cores(), 2)[-1])}
        root = Path(__file__).resolve().parents[2]
        self._proc = subprocess.Popen([sys.executable, "-m", "tests.e2e.plain_vllm", str(model)], cwd=root, env=env,
                                      stdin=subprocess.PIPE, stdout=self._log, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True)
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(spec))
        self._proc.stdin.close()
        self._outputs: list[dict] | None = None

    def outputs(self) -> list[dict]:
        """One `{"token_ids", "text"}` per case, then per chat, in the spec's order."""
        if self._outputs is None:
            self._proc.wait(REFERENCE_TIMEOUT_S)
            lines = Path(self._log.name).read_text(errors="replace").splitlines()
            result = [line for line in lines if line.startswith("RESULT ")]
            assert self._proc.returncode == 0 and result, "\n".join(lines[-40:])
            self._outputs = json.loads(result[-1].removeprefix("RESULT "))
        return self._outputs

    def stop(self) -> None:
        if self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)  # its engine processes too
            self._proc.wait(10)
        self._log.close()
        os.unlink(self._log.name)


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from services.engines.lora import LoraConfig
    from services.engines.model_facts import read_model_facts
    from services.engines.vllm_images import IMAGES_PER_PROMPT
    from services.engines.vllm_lora import lora_engine_args

    model = sys.argv[1]
    spec = json.load(sys.stdin)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    facts = read_model_facts(model)
    # As VllmEngine.start and the worker's defaults (--max-loras 4, --max-lora-rank 16) set them.
    extra = dict(lora_engine_args(LoraConfig(enabled=True))) if spec.get("adapters") else {}
    if facts.vision is not None:
        extra["limit_mm_per_prompt"] = {"image": IMAGES_PER_PROMPT}
    llm = LLM(model=model, block_size=32, max_model_len=spec.get("max_model_len", facts.context_length),
              max_num_seqs=64, enable_prefix_caching=True, enforce_eager=True, **extra)
    ids = {name: i for i, name in enumerate(sorted(spec.get("adapters", {})), start=1)}
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True)
    out = []
    for tokens, lora in spec.get("cases", ()):
        request = LoRARequest(lora, ids[lora], spec["adapters"][lora]) if lora else None
        (result,) = llm.generate([{"prompt_token_ids": tokens}], params, lora_request=request, use_tqdm=False)
        out.append({"token_ids": list(result.outputs[0].token_ids), "text": result.outputs[0].text})
    for messages in spec.get("chats", ()):
        (result,) = llm.chat(messages, params, use_tqdm=False)
        out.append({"token_ids": list(result.outputs[0].token_ids), "text": result.outputs[0].text})
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
