"""Calibration before any RL: how large each fleet's numerics mismatch is, and how large one update is.

* :func:`numerics_table`: each group's copy of the *same* weights (staleness 0) samples held-out answers with the
  full vocabulary; the exact ``KL(q || p)`` over the vocabulary, the total variation and the share of sampled
  tokens with ``p(y) / q(y)`` outside the mixed-fleet study's band [0.2, 5] are averaged over the answer positions,
  per group and capacity-weighted per fleet; also the mean ``|log r|`` of the sampled tokens, with a
  mixture-of-experts policy the share of (token, layer) routes whose expert set the sampler's copy changes
  (``route_flip``, over every scored position), and for each candidate MIS band the share of sampled tokens it
  would mask (``masked <lo>-<hi>``).
* :func:`step_kl_table`: the exact on-policy GRPO control for a few steps at each candidate learning rate; the
  mean exact ``KL(p_v || p_{v+1})`` between consecutive trainer versions. A sampler ``k`` versions behind adds
  mismatch of the order of ``k**2`` times this, which sets how much of a run's mismatch staleness contributes
  beside the fleet's numerics (docs/demo.md, "Calibration of the current regime").
"""

from __future__ import annotations

import math

import torch

from offpolicy.demo.model import ModelConfig, TinyLM, route_flips
from offpolicy.demo.probe import EXTREME_BAND
from offpolicy.demo.rollout import rollout
from offpolicy.demo.simulated_fleet import build_fleet, sampler_copy
from offpolicy.demo.task import SortTask

#: Fleet configurations whose numerics are measured: (label, fleet, weight format).
CONFIGS = (
    ("mixed (study formats)", "mixed", "seed"),
    ("mixed, all bf16", "mixed", "bf16"),
    ("mixed, all fp8", "mixed", "fp8"),
    ("mixed, all nvfp4", "mixed", "nvfp4"),
    ("mixed, all mxfp4", "mixed", "mxfp4"),
    ("homogeneous", "homogeneous", "seed"),
    ("on-policy", "onpolicy", "seed"),
)


#: Grid C's configurations (staleness 0, one weight format per mixed fleet).
CONFIGS_C = (
    ("mixed, all bf16", "mixed", "bf16"),
    ("mixed, all fp8", "mixed", "fp8"),
    ("mixed, all nvfp4", "mixed", "nvfp4"),
    ("mixed, all mxfp4", "mixed", "mxfp4"),
    ("homogeneous", "homogeneous", "seed"),
    ("on-policy", "onpolicy", "seed"),
)


def numerics_table(task: SortTask, model_cfg: ModelConfig, state: dict, prompts: int = 128, seed: int = 0,
                   only: set[tuple[str, str]] | None = None, configs=CONFIGS,
                   bands: tuple[tuple[float, float], ...] = ()) -> list[dict]:
    """One row per (configuration, group) and one ``group="(fleet)"`` row per configuration, capacity-weighted;
    ``only``: measure just the ``(fleet, weight format)`` pairs given (default: every entry of :data:`CONFIGS`).

    Rows hold ``config``, ``group``, ``weights``, ``capacity_share``, ``kl`` (exact ``KL(q || p)`` per token),
    ``tv``, ``extreme_frac`` (share of sampled tokens with ratio outside [0.2, 5]), ``abs_log_ratio``, and with
    experts ``route_flip``; ``masked <lo>-<hi>`` per entry of ``bands``."""
    trainer = TinyLM(model_cfg)
    trainer.load_state_dict(state)
    trainer.eval()
    numbers = task.sample_numbers(prompts, torch.Generator().manual_seed(seed), heldout=True)
    prompt_ids = task.prompts(numbers)
    lo, hi = math.log(EXTREME_BAND[0]), math.log(EXTREME_BAND[1])
    rows = []
    for label, fleet, fmt in configs:
        if only is not None and (fleet, fmt) not in only:
            continue
        groups = build_fleet(fleet, 0.0, fmt)
        total = sum(g.group.capacity for g in groups)
        agg = {"kl": 0.0, "tv": 0.0, "extreme_frac": 0.0, "abs_log_ratio": 0.0}
        agg.update({"route_flip": 0.0} if model_cfg.is_moe else {})
        agg.update({_band(b): 0.0 for b in bands})
        for g in groups:
            copy = sampler_copy(trainer, g)
            out = rollout(copy, prompt_ids, task.answer_len, temperature=1.0, top_p=1.0, head_k=1,
                          generator=torch.Generator().manual_seed(seed + 1))
            seq = torch.cat([prompt_ids, out.tokens], dim=1)
            with torch.no_grad():
                logq = torch.log_softmax(copy(seq[:, :-1])[:, task.prompt_len - 1:].float(), dim=-1)
                logp = torch.log_softmax(trainer(seq[:, :-1])[:, task.prompt_len - 1:].float(), dim=-1)
            flips = (route_flips(copy.last_natural_routes, trainer.last_natural_routes).float().mean()
                     if model_cfg.is_moe else None)
            q = logq.exp()
            tok = out.tokens.unsqueeze(-1)
            log_ratio = (logp.gather(-1, tok) - logq.gather(-1, tok)).squeeze(-1)
            row = {"kl": float((q * (logq - logp)).sum(-1).mean()),
                   "tv": float(0.5 * (q - logp.exp()).abs().sum(-1).mean()),
                   "extreme_frac": float(((log_ratio < lo) | (log_ratio > hi)).float().mean()),
                   "abs_log_ratio": float(log_ratio.abs().mean())}
            if flips is not None:
                row["route_flip"] = float(flips)
            for b in bands:
                row[_band(b)] = float(((log_ratio < math.log(b[0])) | (log_ratio > math.log(b[1]))).float().mean())
            share = g.group.capacity / total
            for key in agg:
                agg[key] += share * row[key]
            rows.append(dict(config=label, group=g.name, weights=g.group.weight_format, capacity_share=share,
                             **row))
        rows.append(dict(config=label, group="(fleet)", weights=fmt, capacity_share=1.0, **agg))
    return rows


def _band(b: tuple[float, float]) -> str:
    return f"masked {b[0]:g}-{b[1]:g}"


def step_kl_table(task: SortTask, model_cfg: ModelConfig, state: dict, lrs: list[float], steps: int,
                  seed: int = 0) -> list[dict]:
    """Per learning rate: mean and max exact step KL of the on-policy GRPO control over ``steps`` steps, and its
    exact held-out success before and after."""
    from offpolicy.demo.train import RunConfig, run

    rows = []
    for lr in lrs:
        res = run(RunConfig(arm="grpo", fleet="onpolicy", seed=seed, steps=steps, lr=lr, eval_every=steps),
                  task, model_cfg, state)
        kls = [h["step_kl"] for h in res["history"]]
        rows.append({"lr": lr, "steps": steps, "step_kl_mean": sum(kls) / len(kls), "step_kl_max": max(kls),
                     "success_start": res["evals"][0]["success_exact"],
                     "success_end": res["evals"][-1]["success_exact"]})
    return rows
