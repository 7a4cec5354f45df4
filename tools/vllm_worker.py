"""An offline vLLM engine behind a pipe, for the live tests: run with the engine's own interpreter.

    .venv-vllm/bin/python tools/vllm_worker.py --model DIR --logprobs-mode raw_logprobs

It starts ``vllm.LLM`` once (about 23 s on 2 CPU cores), prints ``{"ready": true}``, then answers one JSON line per
JSON line read from stdin: ``{"prompts": [[token ids], ...], "sampling_params": {...vllm.SamplingParams kwargs}}``
gives ``{"outputs": [{"prompt_token_ids": [...], "outputs": [{"token_ids": [...], "logprobs": [[[id, logprob,
rank], ...] per token], "finish_reason": str}]}, ...]}`` (``-inf`` written as JSON ``-Infinity``, which Python's
json reads back). An empty line or end of input stops it. Everything else vLLM prints goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _encode(request_output: object) -> dict:
    outs = []
    for comp in request_output.outputs:
        steps = [[[int(i), float(lp.logprob), lp.rank] for i, lp in step.items()] for step in (comp.logprobs or [])]
        outs.append({"token_ids": [int(t) for t in comp.token_ids], "logprobs": steps,
                     "finish_reason": comp.finish_reason})
    return {"prompt_token_ids": [int(t) for t in request_output.prompt_token_ids], "outputs": outs}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--logprobs-mode", default="processed_logprobs")
    ap.add_argument("--max-logprobs", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-cache-mib", type=int, default=256,
                    help="KV cache size; without it vLLM reserves a share of host memory (and fails when shared)")
    args = ap.parse_args()
    # keep every print of vLLM (and of the engine-core process it spawns, which inherits fd 1) off the reply
    # channel: replies go to a private duplicate of the original stdout, fd 1 becomes stderr
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model, dtype="float32", skip_tokenizer_init=True, logprobs_mode=args.logprobs_mode,
              max_logprobs=args.max_logprobs, seed=args.seed, max_model_len=256, enforce_eager=True,
              gpu_memory_utilization=0.05, kv_cache_memory_bytes=args.kv_cache_mib << 20)
    reply.write(json.dumps({"ready": True}) + "\n")
    reply.flush()
    for line in sys.stdin:
        if not line.strip():
            break
        req = json.loads(line)
        params = SamplingParams(**req["sampling_params"])
        results = llm.generate([{"prompt_token_ids": p} for p in req["prompts"]], params, use_tqdm=False)
        reply.write(json.dumps({"outputs": [_encode(r) for r in results]}) + "\n")
        reply.flush()


if __name__ == "__main__":
    main()
