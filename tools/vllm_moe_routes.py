"""Ask vLLM for a MoE model's routed experts (issue 46, item 5): run with the engine's own interpreter.

    .venv-vllm/bin/python tools/vllm_moe_routes.py --model DIR [--no-routes] [--v2-runner]

Starts ``vllm.LLM`` on ``DIR`` (float32, eager, 256 MiB KV cache), with ``enable_return_routed_experts=True`` unless
``--no-routes``, generates 6 tokens from one prompt, and prints one JSON line: ``{"vllm": version, "ok": true,
"prompt": [...], "tokens": [...], "logprobs": [raw log-prob of each token], "routes": [[[id, ...] per layer] per position] or null, "seconds": s}``, or
``{"vllm": version, "ok": false, "stage": "start" | "generate", "error": "<type>: <message>"}`` when the engine
refuses. ``--v2-runner`` sets ``VLLM_USE_V2_MODEL_RUNNER=1`` (vLLM 0.32 wires routed experts to that runner only).
Everything vLLM prints goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--no-routes", action="store_true")
    ap.add_argument("--v2-runner", action="store_true")
    args = ap.parse_args()
    if args.v2_runner:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    t0 = time.monotonic()
    import vllm
    from vllm import LLM, SamplingParams

    out = {"vllm": vllm.__version__}
    kwargs = {} if args.no_routes else {"enable_return_routed_experts": True}
    try:
        llm = LLM(model=args.model, dtype="float32", skip_tokenizer_init=True, seed=0, max_model_len=256,
                  enforce_eager=True, gpu_memory_utilization=0.05, kv_cache_memory_bytes=256 << 20, **kwargs)
    except Exception as exc:  # the finding is the refusal itself
        out.update(ok=False, stage="start", error=f"{type(exc).__name__}: {exc}")
    else:
        try:
            res = llm.generate([{"prompt_token_ids": [5, 17, 33, 100]}],
                               SamplingParams(max_tokens=6, temperature=1.0, seed=1, logprobs=0), use_tqdm=False)
            comp = res[0].outputs[0]
            routes = getattr(comp, "routed_experts", None)
            out.update(ok=True, prompt=[int(t) for t in res[0].prompt_token_ids],
                       tokens=[int(t) for t in comp.token_ids],
                       logprobs=[float(step[t].logprob) for t, step in zip(comp.token_ids, comp.logprobs or [])],
                       routes=None if routes is None else routes.tolist())
        except Exception as exc:
            out.update(ok=False, stage="generate", error=f"{type(exc).__name__}: {exc}")
    out["seconds"] = round(time.monotonic() - t0, 1)
    reply.write(json.dumps(out) + "\n")
    reply.flush()


if __name__ == "__main__":
    main()
