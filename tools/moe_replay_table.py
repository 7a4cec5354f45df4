"""Measured table: how much of a quantised MoE sampler's mismatch routing replay removes (issue 46).

A tiny Qwen3-MoE (transformers, built from a config) is first trained on a toy task, so its next-token
distributions and its routers are peaked like a real model's rather than near-uniform at random init. Then, per weight
format, a fake-quantised copy (the sampler) samples continuations and records its routes; the unquantised model (the
trainer) scores the same tokens twice: routing by itself (natural) and with the sampler's routes replayed
(``offpolicy.routing.replay_routes``: the sampler's expert ids, the trainer's own router weights over them).

Per format it reports, over the generated tokens, with ``log r = log p_trainer - log q_sampler``:

* ``k3``: mean of ``(r - 1) - log r`` (the k3 estimator of KL(q || p) on samples from q), natural and replayed;
* ``outside``: share of tokens with ``r`` outside ``[0.5, 5]``, natural and replayed (``outside_tight``: outside
  ``[0.8, 1.25]``, a band this small model's mismatch does reach);
* ``flipped_layers``: mean number of routed layers per token whose top-k *set* differs between sampler and trainer,
  at the positions that predict the generated tokens (``tokens_with_flip``: share of them with at least one flip;
  ``flipped_layers_with_prompt``: the mean over the prompt positions too, whose flips also reach the generated
  tokens through attention);
* ``routing_share``: ``1 - k3_replay / k3_natural``, the share of the mismatch that replay removes;
* ``shapley``: what ``offpolicy diagnose --attribute`` reports for the same tokens
  (:func:`offpolicy.diagnose.attribute`, every generated token, the sampler's recorded routes replayed through
  ``replay_routes``, the group declared in its format): each part's Shapley share of the mean ``|log r|`` and of the
  k3 (``routing_shapley`` / ``routing_shapley_k3`` in the table). Its format cause re-scores with
  ``fake_quantize_module`` (every ``nn.Linear`` but ``lm_head``: the attention projections); the fused experts
  (``Qwen3MoeExperts``' 3-D tensors, no ``nn.Linear``) that the sampler quantised are not re-quantised there, so
  their share stays in the residual.

What is quantised (as serving stacks do with FP8 / FP4 Qwen3-MoE checkpoints): the attention projections and every
expert's weights; the routers (``mlp.gate``), embeddings, norms and the output layer stay in full precision. The
quantisers are the project's (``offpolicy.fleet.quant.fake_quantize``). Seeded; one thread.

    python tools/moe_replay_table.py                      # writes benchmarks/results/moe_replay_table.{json,md}
    python tools/moe_replay_table.py --tiny --out DIR     # the test's size
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from offpolicy.diagnose import RecordedRollouts, attribute  # noqa: E402
from offpolicy.diagnose.attribution import NEGLIGIBLE  # noqa: E402
from offpolicy.fleet.quant import fake_quantize  # noqa: E402
from offpolicy.routing import capture_routes, moe_layers, replay_routes  # noqa: E402

FORMATS = ("fp8", "nvfp4", "mxfp4")
BAND = (0.5, 5.0)
TIGHT = (0.8, 1.25)

FULL = dict(vocab=256, hidden=64, layers=4, experts=8, top_k=2, train_steps=600, train_batch=32, train_len=32,
            sequences=128, prompt=4, new_tokens=28)
TINY = dict(vocab=64, hidden=32, layers=2, experts=8, top_k=2, train_steps=30, train_batch=8, train_len=16,
            sequences=8, prompt=4, new_tokens=8)


def build_model(size: dict, seed: int):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    h = size["hidden"]
    cfg = Qwen3MoeConfig(vocab_size=size["vocab"], hidden_size=h, intermediate_size=2 * h, moe_intermediate_size=h,
                         num_hidden_layers=size["layers"], num_attention_heads=4, num_key_value_heads=2,
                         head_dim=h // 4, num_experts=size["experts"], num_experts_per_tok=size["top_k"],
                         norm_topk_prob=True, max_position_embeddings=128, tie_word_embeddings=False,
                         router_aux_loss_coef=0.01)
    cfg._experts_implementation = "eager"
    return Qwen3MoeForCausalLM(cfg).float()


def toy_chain(vocab: int, seed: int) -> torch.Tensor:
    """A sparse random Markov chain: each token has 4 likely successors (probabilities 0.55 / 0.25 / 0.12 / 0.05) and
    a 3% uniform floor; ``[V, V]`` transition matrix."""
    g = torch.Generator().manual_seed(seed)
    p = torch.full((vocab, vocab), 0.03 / vocab)
    for i in range(vocab):
        succ = torch.randperm(vocab, generator=g)[:4]
        p[i, succ] += torch.tensor([0.55, 0.25, 0.12, 0.05])
    return p / p.sum(-1, keepdim=True)


def sample_chain(chain: torch.Tensor, n: int, length: int, g: torch.Generator) -> torch.Tensor:
    x = torch.empty(n, length, dtype=torch.long)
    x[:, 0] = torch.randint(0, chain.shape[0], (n,), generator=g)
    for t in range(1, length):
        x[:, t] = torch.multinomial(chain[x[:, t - 1]], 1, generator=g)[:, 0]
    return x


def train(model, chain: torch.Tensor, size: dict, seed: int) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    losses = []
    for _ in range(size["train_steps"]):
        x = sample_chain(chain, size["train_batch"], size["train_len"], g)
        out = model(x, labels=x, output_router_logits=True)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(float(out.loss.detach()))
    model.eval()
    return losses


def quantised_copy(model, fmt: str):
    """The sampler: attention projections and experts fake-quantised, router / embeddings / norms / lm_head kept."""
    import copy

    q = copy.deepcopy(model)
    with torch.no_grad():
        for name, mod in q.named_modules():
            if isinstance(mod, torch.nn.Linear) and ".self_attn." in name:
                mod.weight.copy_(fake_quantize(mod.weight, fmt))
            if type(mod).__name__.endswith("Experts"):
                for p in (mod.gate_up_proj, mod.down_proj):
                    for e in range(p.shape[0]):
                        p[e].copy_(fake_quantize(p[e], fmt))
    return q


@torch.no_grad()
def generate(sampler, prompts: torch.Tensor, new_tokens: int, g: torch.Generator) -> torch.Tensor:
    x = prompts
    for _ in range(new_tokens):
        logits = sampler(x).logits[:, -1].double()
        nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=g)
        x = torch.cat([x, nxt], dim=1)
    return x


def token_logprobs(logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """log-prob of x[:, t + 1] under logits[:, t], float64 ``[B, T - 1]``."""
    return torch.log_softmax(logits[:, :-1].double(), -1).gather(-1, x[:, 1:, None])[..., 0]


def flipped_layers(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per token, the number of layers whose expert *sets* differ; ``a``, ``b`` ``[B, T, L, K]`` -> ``[B, T]``."""
    sa, sb = a.long().sort(-1).values, b.long().sort(-1).values
    return (sa != sb).any(-1).sum(-1)


def stats(logr: torch.Tensor) -> dict:
    r = logr.exp()
    return {"k3": float(((r - 1) - logr).mean()), "outside": float(((r < BAND[0]) | (r > BAND[1])).double().mean()),
            "outside_tight": float(((r < TIGHT[0]) | (r > TIGHT[1])).double().mean()),
            "mean_abs_log_r": float(logr.abs().mean()), "max_abs_log_r": float(logr.abs().max())}


@torch.no_grad()
def measure(trainer, fmt: str, chain: torch.Tensor, size: dict, seed: int) -> dict:
    sampler = quantised_copy(trainer, fmt)
    g = torch.Generator().manual_seed(seed)
    prompts = sample_chain(chain, size["sequences"], size["prompt"], g)
    x = generate(sampler, prompts, size["new_tokens"], g)
    with capture_routes(sampler) as cap_q:
        logq = token_logprobs(sampler(x).logits, x)
    with capture_routes(trainer) as cap_p:
        logp_nat = token_logprobs(trainer(x).logits, x)
    with replay_routes(trainer, cap_q.routes):
        logp_rep = token_logprobs(trainer(x).logits, x)
    gen = slice(size["prompt"] - 1, None)  # log-probs of the generated tokens (predicted from position prompt-1 on)
    # routes of the positions whose forward predicts a generated token (their inputs feed the prediction)
    every = flipped_layers(cap_q.routes, cap_p.routes)[:, :-1].double()  # positions that feed a prediction
    flips = every[:, gen]
    nat = stats((logp_nat - logq)[:, gen])
    rep = stats((logp_rep - logq)[:, gen])
    share = 1.0 - rep["k3"] / nat["k3"] if nat["k3"] > 0 else None
    shap = shapley(trainer, x, logq[:, gen], cap_q.routes, fmt, size["prompt"])
    return {"format": fmt, "tokens": int(flips.numel()), "k3_natural": nat["k3"], "k3_replay": rep["k3"],
            "outside_natural": nat["outside"], "outside_replay": rep["outside"],
            "outside_tight_natural": nat["outside_tight"], "outside_tight_replay": rep["outside_tight"],
            "mean_abs_log_r_natural": nat["mean_abs_log_r"], "mean_abs_log_r_replay": rep["mean_abs_log_r"],
            "max_abs_log_r_natural": nat["max_abs_log_r"], "max_abs_log_r_replay": rep["max_abs_log_r"],
            "flipped_layers": float(flips.mean()), "tokens_with_flip": float((flips > 0).double().mean()),
            "flipped_layers_with_prompt": float(every.mean()),
            "routing_share": share, "routing_shapley": shap["routing"], "routing_shapley_k3": shap["routing_k3"],
            "shapley": shap}


def shapley(trainer, x: torch.Tensor, logq: torch.Tensor, routes: torch.Tensor, fmt: str, prompt: int) -> dict:
    """``attribute()`` on the generated tokens ``x[:, prompt:]`` (sampler log-probs ``logq [B, T - prompt]``), one
    group ``fmt`` served at the trainer's version in format ``fmt``, the sampler's ``routes [B, T, L, K]`` replayed:
    the group's slice (``total``, ``parts``: Shapley value and share per part) and the cost."""
    b, t = x.shape
    n = b * (t - prompt)
    rows = torch.arange(b).repeat_interleave(t - prompt)
    cols = torch.arange(prompt, t).repeat(b)
    rec = RecordedRollouts(
        tokens=x[:, prompt:].reshape(-1), sampler_logprobs=logq.reshape(-1).float(), candidates=None,
        group_names=(fmt,), group_index=torch.zeros(n, dtype=torch.int64), versions=torch.zeros(n, dtype=torch.int64),
        seq_ids=rows.clone(), temperature=torch.ones(n), top_p=torch.ones(n), top_k=torch.full((n,), -1),
        contexts=x, rows=rows, cols=cols)

    def replay(model, batch):  # the sampler's routes of the batch's sequences (all of one length: no padding)
        with replay_routes(model, routes[batch.rows]):
            return model(batch.input_ids).logits

    rep = attribute(rec, model=trainer, current_version=0, formats={fmt: fmt}, replay=replay, max_tokens=n,
                    quantize_skip=("lm_head",))
    group = rep.slice("group", fmt)
    none = group.total["mean_abs_log_r"] < NEGLIGIBLE  # nothing to split (the control): no share, as routing_share
    return {"routing": None if none else group.parts["routing"]["share_mean_abs_log_r"],
            "routing_k3": None if none else group.parts["routing"]["share_k3"],
            "total": group.total, "parts": group.parts, "cost": rep.cost}


def markdown(result: dict) -> str:
    size = result["size"]
    lines = [f"Tiny Qwen3-MoE ({size['layers']} routed layers, {size['experts']} experts, top-{size['top_k']}, hidden "
             f"{size['hidden']}, vocab {size['vocab']}; trained {size['train_steps']} steps), "
             f"{result['rows'][0]['tokens']} sampled tokens per format, seed {result['seed']}.", "",
             "| format | k3 natural | k3 replay | routing share (1 - k3 replay / natural) | r outside [0.5, 5]: "
             "natural / replay | r outside [0.8, 1.25]: natural / replay | mean flipped layers | tokens with a flip | "
             "Shapley routing share of mean abs log r / of k3 (diagnose --attribute) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        share = "n/a" if r["routing_share"] is None else f"{r['routing_share']:.2f}"
        lines.append(f"| {r['format']} | {r['k3_natural']:.2e} | {r['k3_replay']:.2e} | {share} | "
                     f"{r['outside_natural']:.2%} / {r['outside_replay']:.2%} | {r['outside_tight_natural']:.2%} / "
                     f"{r['outside_tight_replay']:.2%} | {r['flipped_layers']:.3f} | {r['tokens_with_flip']:.1%} | "
                     + ("n/a |" if r["routing_shapley"] is None else
                        f"{r['routing_shapley']:.2f} / {r['routing_shapley_k3']:.2f} |"))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="the test's size (seconds)")
    ap.add_argument("--formats", default=",".join(FORMATS), help="comma-separated fake-quant formats (fp32: control)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="folder for moe_replay_table.{json,md}")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.monotonic()
    size = TINY if args.tiny else FULL
    chain = toy_chain(size["vocab"], args.seed)
    trainer = build_model(size, args.seed)
    losses = train(trainer, chain, size, args.seed + 1)
    entropy = float(-(chain * chain.log()).sum(-1).mean())
    rows = [measure(trainer, f, chain, size, args.seed + 2) for f in args.formats.split(",")]
    moe = moe_layers(trainer)
    result = {
        "command": "python tools/moe_replay_table.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "seed": args.seed, "size": size, "routed_layers": len(moe),
        "train": {"first_loss": losses[0], "last_loss": float(sum(losses[-10:]) / len(losses[-10:])),
                  "chain_entropy": entropy, "steps": len(losses)},
        "quantised": "attention projections and experts; routers, embeddings, norms and lm_head in fp32",
        "rows": rows,
        "meta": {"python": platform.python_version(), "torch": torch.__version__,
                 "transformers": __import__("transformers").__version__, "threads": torch.get_num_threads(),
                 "machine": platform.machine(), "cpus": os.cpu_count(), "load": os.getloadavg()[0],
                 "date": time.strftime("%Y-%m-%d", time.gmtime()), "seconds": round(time.monotonic() - t0, 1)},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "moe_replay_table.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "moe_replay_table.md").write_text(markdown(result))
    print(markdown(result))
    print(f"train loss {losses[0]:.3f} -> {result['train']['last_loss']:.3f} (chain entropy {entropy:.3f}); "
          f"{result['meta']['seconds']} s", file=sys.stderr)
    assert all(math.isfinite(r["k3_natural"]) for r in rows)
    return result


if __name__ == "__main__":
    main()
