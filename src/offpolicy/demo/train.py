"""One run of the demo: asynchronous GRPO-style RL of the tiny policy on the sorting task, fed by a simulated fleet.

Per optimizer step (version ``v`` of the trainer):

1. draw ``prompts`` training prompts, ``samples`` sessions each; the fleet's router assigns every session to a
   sampler group by capacity;
2. each group samples its sessions with the reference sampler from *its* copy of the weights (version
   ``v_g <= v``, its own numerics), recording the sampled tokens, their log-probabilities and the candidates
   (the top-K head, or the whole top-p support when the arm filters with top-p);
3. binary rewards, GRPO advantages per prompt;
4. the fp32 trainer recomputes the logits and applies :func:`offpolicy.policy_loss` with the arm's correction;
   Adam step with gradient clipping;
5. each group receives version ``v + 1`` or not (see :mod:`offpolicy.demo.simulated_fleet`).

Mismatch is measured the same way for every arm, on full distributions: each group's sessions re-scored by its
copy (teacher forcing, the same numerics; that forward is the sampler's own last one, over the prompt and every
answer token but the last, so it is kept rather than recomputed: :attr:`Rollout.last_logits`), giving the sampler's whole distribution ``q`` at every trained position
(before any top-p filter). The exact ``KL(q || p)`` (``kl_full``), ``tv = 1/2 sum_v |q - p|`` and the share of
sampled tokens whose full-distribution ratio ``p(y) / q(y)`` lies outside the study's band [0.2, 5]
(``extreme_full``) follow. The loss's own figures (``kl_k3``, ``extreme_ratio_frac``) are on the record it was
given: support-renormalised for the top-p arms, so they are reported separately (``*_loss`` columns).
``step_kl`` is the exact ``KL(p_v || p_{v+1})`` on the step's positions, the size of one update.

With a mixture-of-experts policy the same re-scoring pass records each group's routes (the sampler's forward over
the sampled sequence, in its numerics; the reference sampler re-runs the whole sequence at every step, so this is
the computation that chose each token) and ``route_flip`` is the share of (token, layer) pairs of the trained
positions whose expert set differs between the sampler and the trainer's own router (``route_flip_by_group`` per
group). A routing-replay arm gives those routes to the trainer's forward (:attr:`TinyLM.replay`), so its ``p`` and
gradient use the sampler's experts; ``route_flip`` is then what replay removed.

Held-out success is measured exactly (``success_exact = mean prod_t p(y*_t)`` by teacher forcing) and by sampling
(pass@1, pass@k), from the trainer's weights with full-vocabulary sampling, identical for every arm; and
``success_exact_topp``, the exact success under the trainer's own nucleus (top-p of ``RunConfig.top_p``,
renormalised: the probability that top-p sampling from the trainer answers correctly), the outcome that matches
arms trained with top-p. At each
evaluation the drift probe (:mod:`offpolicy.demo.probe`) measures the arm's expected update against every group's
numerics at the trainer's current weights.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch
from torch import Tensor

import offpolicy as op
from offpolicy.demo.arms import ARMS
from offpolicy.demo.probe import EXTREME_BAND, drift_readouts, expected_update, make_probe_set, probe_logits
from offpolicy.demo.simulated_fleet import FLEETS, SimulatedFleet, build_fleet, describe, sampler_copy
from offpolicy.demo.model import ModelConfig, TinyLM, route_flips
from offpolicy.demo.rollout import rollout
from offpolicy.demo.task import SortTask
from offpolicy.demo.warmup import expected_success
from offpolicy.fleet import FleetMetrics

#: Fixed seed of the held-out evaluation prompts: every arm and seed is evaluated on the same prompts.
EVAL_PROMPT_SEED = 777
#: Fixed seed of the drift probe's prefixes (held-out prompts, shared by every run).
PROBE_SEED = 4242


@dataclass(frozen=True)
class RunConfig:
    """Everything that defines one run (an arm on a fleet with a seed). Identical across arms but ``arm``.

    Attributes:
        arm, fleet, seed: what runs (see :data:`~offpolicy.demo.arms.ARMS`, :data:`~offpolicy.demo.simulated_fleet.FLEETS`).
        steps, prompts, samples: optimizer steps; prompts per step; sessions (samples) per prompt.
        lr, grad_clip: Adam learning rate; global gradient-norm clip (0 disables).
        top_p: the top-p of the arms that filter; ``head_k``: candidates recorded by the other arms.
        temperature: sampling temperature.
        staleness, max_staleness: the fleet's mean staleness in steps, and its cap (None: unbounded).
        weight_format, kv_format, compute: the mixed fleet's numerics (see :func:`build_fleet`).
        eval_every, eval_prompts, eval_samples, pass_k: held-out pass@k from the trainer's weights, full
            vocabulary sampling at temperature 1 (at the first and last evaluation); the exact teacher-forced
            success on the same prompts at every evaluation.
        probe_prefixes: size of the drift probe's fixed prefix set.
        mis_bounds: None (the arm's own MIS band) or ``(lower, upper)`` replacing it in the MIS arms (a grid's
            registered band).
        tag: appended to the run id (``arm@fleet~tag/s<seed>``) to tell apart runs of one arm and fleet that
            differ in another setting (grid C: ``st4`` for its staleness-4 contrast); empty for none.
    """

    arm: str
    fleet: str
    seed: int = 0
    steps: int = 150
    prompts: int = 16
    samples: int = 8
    lr: float = 1e-4
    grad_clip: float = 1.0
    top_p: float = 0.95
    head_k: int = 8
    temperature: float = 1.0
    staleness: float = 4.0
    max_staleness: int | None = None
    weight_format: str = "seed"
    kv_format: str = "fp8"
    compute: str = "bf16"
    eval_every: int = 50
    eval_prompts: int = 128
    eval_samples: int = 8
    pass_k: int = 4
    probe_prefixes: int = 32
    mis_bounds: tuple[float, float] | None = None
    tag: str = ""

    def __post_init__(self) -> None:
        if self.mis_bounds is not None:
            lo, hi = self.mis_bounds
            if not (0 <= lo < 1 < hi and math.isfinite(hi)):
                raise ValueError(f"mis_bounds must be (lower, upper) with 0 <= lower < 1 < upper, got {self.mis_bounds}")
        if any(c in self.tag for c in "/@:~ "):
            raise ValueError(f"tag must not contain '/', '@', ':', '~' or spaces, got {self.tag!r}")
        if self.arm not in ARMS:
            raise ValueError(f"arm must be one of {list(ARMS)}, got {self.arm!r}")
        if self.fleet not in FLEETS:
            raise ValueError(f"fleet must be one of {FLEETS}, got {self.fleet!r}")
        for name in ("steps", "prompts", "eval_every", "eval_prompts", "head_k", "probe_prefixes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.samples < 2:
            raise ValueError(f"samples must be >= 2 (GRPO compares samples of one prompt), got {self.samples}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a positive number, got {self.lr}")
        if self.grad_clip < 0:
            raise ValueError(f"grad_clip must be >= 0 (0 disables), got {self.grad_clip}")
        if not 1 <= self.pass_k <= self.eval_samples:
            raise ValueError(f"pass_k must lie in [1, eval_samples={self.eval_samples}], got {self.pass_k}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")

    @property
    def run_id(self) -> str:
        fmt = f":{self.weight_format}" if self.fleet == "mixed" and self.weight_format != "seed" else ""
        tag = f"~{self.tag}" if self.tag else ""
        return f"{self.arm}@{self.fleet}{fmt}{tag}/s{self.seed}"

    def correction(self) -> op.Correction:
        """The arm's correction, with ``mis_bounds`` as its MIS band when set."""
        c = ARMS[self.arm].correction
        if self.mis_bounds is not None and c.weights == "mis":
            c = replace(c, bounds=tuple(self.mis_bounds))
        return c


def pass_at_k(n: int, c: Tensor, k: int) -> Tensor:
    """Unbiased pass@k per prompt from ``c [P]`` correct answers out of ``n`` samples (Chen et al. 2021):
    ``1 - C(n - c, k) / C(n, k)``, computed as a product to stay exact in floating point."""
    c = c.to(torch.float64)
    out = torch.ones_like(c)
    # C(n-c, k) / C(n, k) = prod_{i=0}^{k-1} (n - c - i) / (n - i), zero as soon as n - c < k.
    for i in range(k):
        out = out * ((n - c - i).clamp_min(0) / (n - i))
    return 1.0 - out


def evaluate(model: TinyLM, task: SortTask, cfg: RunConfig, numbers: Tensor, gen: torch.Generator,
             sampled: bool = True) -> dict:
    """Held-out success of ``model`` (the trainer's weights): exact (teacher forcing), and with ``sampled``
    pass@1 / pass@k by full-vocabulary sampling at temperature 1 (nan without)."""
    # The scratchpad (if any) is drawn from a fixed generator: every arm and step sees the same random numbers.
    exact = float(expected_success(model, task, numbers, torch.Generator().manual_seed(EVAL_PROMPT_SEED + 1)).mean())
    nucleus = float(expected_success(model, task, numbers, torch.Generator().manual_seed(EVAL_PROMPT_SEED + 1),
                                     top_p=cfg.top_p).mean())
    if not sampled:
        return {"success_exact": exact, "success_exact_topp": nucleus, "pass@1": math.nan,
                f"pass@{cfg.pass_k}": math.nan}
    prompts = task.prompts(numbers).repeat_interleave(cfg.eval_samples, dim=0)
    out = rollout(model, prompts, task.answer_len, temperature=1.0, top_p=1.0, head_k=1, generator=gen)
    correct = task.reward(prompts, out.tokens).view(-1, cfg.eval_samples).sum(1)
    return {"success_exact": exact, "success_exact_topp": nucleus, "pass@1": float(pass_at_k(cfg.eval_samples, correct, 1).mean()),
            f"pass@{cfg.pass_k}": float(pass_at_k(cfg.eval_samples, correct, cfg.pass_k).mean())}


def probe_drift(trainer: TinyLM, groups: list, task: SortTask, cfg: RunConfig, probes) -> dict[str, float]:
    """The drift probe's read-outs for this run's arm at both advantage signs (``<name>_pos`` at correct prefixes
    with a = +1, ``<name>_neg`` at wrong ones with a = -1), averaged over the groups by capacity; each group's
    ``q`` is its numerics applied to the trainer's current weights (staleness aside)."""
    arm = replace(ARMS[cfg.arm], correction=cfg.correction())
    with torch.no_grad():
        z = probe_logits(trainer, task, probes) / cfg.temperature
    total = sum(g.group.capacity for g in groups)
    out: dict[str, float] = {}
    memo: dict = {}
    for g in groups:
        with torch.no_grad():
            logq = torch.log_softmax(probe_logits(sampler_copy(trainer, g, memo), task, probes) / cfg.temperature,
                                     -1)
        for sign, suffix in ((1.0, "_pos"), (-1.0, "_neg")):
            rows = probes.advantage == sign
            u = expected_update(z[rows], logq[rows], arm, cfg.top_p, cfg.head_k, advantage=sign)
            for key, val in drift_readouts(z[rows], logq[rows], u, arm, task.max_value).items():
                key = key if key == "kl_qp" else key + suffix
                out[key] = out.get(key, 0.0) + val * g.group.capacity / total / (2 if key == "kl_qp" else 1)
    return out


def run(cfg: RunConfig, task: SortTask, model_cfg: ModelConfig, init_state: dict[str, Tensor],
        progress: Callable[[int, dict], None] | None = None) -> dict:
    """Train one arm; return a JSON-ready dict: ``config``, ``groups`` (fleet and per-group totals),
    ``history`` (one dict per step), ``evals`` (held-out pass@k over steps), ``seconds``."""
    t0 = time.perf_counter()
    arm = ARMS[cfg.arm]
    gen = torch.Generator().manual_seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    if arm.route_replay and not model_cfg.is_moe:
        raise ValueError(f"arm {cfg.arm!r} replays MoE routes: the policy needs experts (ModelConfig.n_experts > 0)")
    correction = cfg.correction()
    trainer = TinyLM(model_cfg)
    trainer.load_state_dict(init_state)
    opt = torch.optim.Adam(trainer.parameters(), lr=cfg.lr)
    groups = build_fleet(cfg.fleet, cfg.staleness, cfg.weight_format, cfg.kv_format, cfg.compute)
    fleet = SimulatedFleet(groups, trainer, gen, cfg.max_staleness)
    n_groups = len(groups)
    eval_numbers = task.sample_numbers(cfg.eval_prompts, torch.Generator().manual_seed(EVAL_PROMPT_SEED),
                                       heldout=True)
    eval_gen = torch.Generator().manual_seed(cfg.seed + 1_000_003)
    top_p = cfg.top_p if arm.top_p else 1.0
    fleet_metrics = FleetMetrics([g.group for g in groups])
    totals = {k: torch.zeros(n_groups, dtype=torch.float64)
              for k in ("tokens", "tv", "kl_full", "extreme_full", "staleness", "route_flip")}
    probes = make_probe_set(task, cfg.probe_prefixes, PROBE_SEED)
    history: list[dict] = []

    def checkpoint(step: int) -> dict:
        # Sampled pass@k (costly) at the start and the end only; the exact success at every evaluation.
        sampled = step in (0, cfg.steps)
        return dict(step=step, **evaluate(trainer, task, cfg, eval_numbers, eval_gen, sampled),
                    **{f"drift_{k}": v for k, v in probe_drift(trainer, groups, task, cfg, probes).items()})

    evals: list[dict] = [checkpoint(0)]
    lo_band, hi_band = math.log(EXTREME_BAND[0]), math.log(EXTREME_BAND[1])
    session = 0
    for step in range(cfg.steps):
        numbers = task.sample_numbers(cfg.prompts, gen)
        prompts = task.prompts(numbers).repeat_interleave(cfg.samples, dim=0)
        b = prompts.shape[0]
        prompt_ids = torch.arange(cfg.prompts).repeat_interleave(cfg.samples)
        group_of = fleet.route(list(range(session, session + b)))
        session += b
        L = task.answer_len
        tokens = torch.empty(b, L, dtype=torch.int64)
        lq = torch.empty(b, L)
        q_full = torch.empty(b, L, task.vocab_size)
        seq_len = task.prompt_len + L - 1
        routes = (torch.empty(b, seq_len, model_cfg.n_layers, model_cfg.top_k, dtype=torch.int64)
                  if model_cfg.is_moe else None)
        records = []
        for g in range(n_groups):
            idx = (group_of == g).nonzero().squeeze(1)
            if idx.numel() == 0:
                continue
            out = rollout(fleet.models[g], prompts[idx], L, temperature=cfg.temperature, top_p=top_p,
                          head_k=cfg.head_k, generator=gen)
            tokens[idx], lq[idx] = out.tokens, out.logprobs
            records.append((idx, out.cand_ids, out.cand_logprobs))
            if out.last_logits is not None:
                # The sampler's last forward is the re-scoring forward (same input, same copy): no second pass.
                q_full[idx] = torch.softmax(out.last_logits[:, task.prompt_len - 1:].float() / cfg.temperature, -1)
            else:
                q_full[idx] = _rescore(fleet.models[g], prompts[idx], out.tokens, cfg.temperature)
            if routes is not None:
                routes[idx] = fleet.models[g].last_routes
        width = max(r[1].shape[-1] for r in records)
        cand_ids = torch.full((b, L, width), -1, dtype=torch.int64)
        cand_lp = torch.full((b, L, width), -math.inf)
        for idx, ids, lp in records:
            cand_ids[idx, :, : ids.shape[-1]] = ids
            cand_lp[idx, :, : lp.shape[-1]] = lp
        versions_g = torch.tensor(fleet.versions, dtype=torch.int64)
        rewards = task.reward(prompts, tokens)
        adv = op.advantages.grpo(rewards, prompt_ids)

        seq = torch.cat([prompts, tokens], dim=1)
        trainer.replay = routes if arm.route_replay else None
        logits = trainer(seq[:, :-1])[:, task.prompt_len - 1:].reshape(b * L, -1)
        if routes is not None:
            # (token, layer) pairs at the trained positions whose expert set the trainer's own router would change.
            flips = route_flips(trainer.last_natural_routes, routes)[:, task.prompt_len - 1:].float().mean(-1)
            flips = flips.reshape(-1)
        seq_ids = torch.arange(b).repeat_interleave(L)
        tok_group = group_of.repeat_interleave(L)
        res = op.policy_loss(
            logits, tokens.reshape(-1), lq.reshape(-1), adv[seq_ids],
            candidates=op.Candidates(cand_ids.reshape(b * L, -1), cand_lp.reshape(b * L, -1),
                                     kind=arm.record_kind),
            temperature=cfg.temperature, correction=correction, seq_ids=seq_ids, groups=tok_group,
            versions=versions_g[tok_group], current_version=step,
        )
        opt.zero_grad(set_to_none=True)
        res.loss.backward()
        max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
        # clip_grad_norm_ returns the total norm *before* clipping: the record is the pre-clip norm.
        grad_norm = float(torch.nn.utils.clip_grad_norm_(trainer.parameters(), max_norm))
        finite = math.isfinite(grad_norm)
        if finite:
            opt.step()
        with torch.no_grad():
            logp_new = torch.log_softmax(trainer(seq[:, :-1])[:, task.prompt_len - 1:].reshape(b * L, -1).float()
                                         / cfg.temperature, dim=-1)
        trainer.replay = None

        with torch.no_grad():
            logp = torch.log_softmax(logits.detach().float() / cfg.temperature, dim=-1)
            p = logp.exp()
            q = q_full.reshape(b * L, -1)
            logq = q.clamp_min(1e-30).log()
            tv = 0.5 * (q - p).abs().sum(-1)
            kl_full = (q * (logq - logp)).sum(-1)
            step_kl = (p * (logp - logp_new)).sum(-1)
            flat = tokens.reshape(-1, 1)
            log_ratio = (logp.gather(1, flat) - logq.gather(1, flat)).squeeze(1)
            extreme = ((log_ratio < lo_band) | (log_ratio > hi_band)).to(torch.float64)
            entropy = -(p * logp).sum(-1)
            fleet_metrics.update(tok_group, lq.reshape(-1), res.logprobs, seq_ids=seq_ids)
            stale = (step - versions_g[tok_group]).to(torch.float64)
            totals["tokens"] += torch.bincount(tok_group, minlength=n_groups)
            per_token = [("tv", tv), ("kl_full", kl_full), ("extreme_full", extreme), ("staleness", stale)]
            if routes is not None:
                per_token.append(("route_flip", flips))
            for key, val in per_token:
                totals[key] += torch.bincount(tok_group, weights=val.to(torch.float64), minlength=n_groups)
        m = res.metrics
        row = {
            "step": step,
            "reward": float(rewards.mean()),
            "kl_full": float(kl_full.mean()),
            "extreme_full": float(extreme.mean()),
            "extreme_by_group": _per_group_mean(extreme, tok_group, n_groups),
            "tv": float(tv.mean()),
            "abs_log_ratio": float(log_ratio.abs().mean()),
            "route_flip": float(flips.mean()) if routes is not None else math.nan,
            "route_flip_by_group": _per_group_mean(flips, tok_group, n_groups) if routes is not None else [],
            "step_kl": float(step_kl.mean()),
            "kl_k3_loss": float(m["kl_k3"]),
            "extreme_loss": float(m["extreme_ratio_frac"]),
            "grad_norm_preclip": grad_norm,
            "clipped": finite and grad_norm > max_norm,
            "entropy": float(entropy.mean()),
            "weight_mean": float(m["weight_mean"]),
            "masked_frac": float(m["ratio_below_lower_frac"] + m["ratio_above_upper_frac"])
            if correction.weights == "mis" else 0.0,
            "support_size": float(m["support_size"]) if "support_size" in m else float("nan"),
            "staleness": float((step - versions_g[tok_group]).float().mean()),
            "loss": float(res.loss.detach()),
            "skipped": not finite,
        }
        history.append(row)
        fleet.after_step(trainer, step + 1)
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            evals.append(checkpoint(step + 1))
        if progress is not None:
            progress(step + 1, row)

    tok = totals["tokens"].clamp_min(1)
    n_extreme = totals["extreme_full"].sum().clamp_min(1)
    table = fleet_metrics.table()
    group_rows = []
    for i, (d, row) in enumerate(zip(describe(groups), table.rows)):
        group_rows.append(dict(
            d,
            share_samples=float(totals["tokens"][i] / totals["tokens"].sum()),
            share_extreme=float(totals["extreme_full"][i] / n_extreme),
            extreme_frac=float(totals["extreme_full"][i] / tok[i]),
            kl_full=float(totals["kl_full"][i] / tok[i]),
            tv=float(totals["tv"][i] / tok[i]),
            staleness=float(totals["staleness"][i] / tok[i]),
            route_flip=float(totals["route_flip"][i] / tok[i]) if model_cfg.is_moe else math.nan,
            share_extreme_loss=row.share_extreme,
            kl_k3_loss=row.kl_k3,
        ))
    return {"config": asdict(cfg), "run_id": cfg.run_id, "label": arm.label, "groups": group_rows,
            "fleet_table": table.format(),
            "history": history, "evals": evals, "seconds": time.perf_counter() - t0}


def _per_group_mean(x: Tensor, group: Tensor, n_groups: int) -> list[float]:
    """Mean of ``x [N]`` over each group's entries of ``group [N]`` (nan for a group with none this step)."""
    n = torch.bincount(group, minlength=n_groups).to(torch.float64)
    s = torch.bincount(group, weights=x.to(torch.float64), minlength=n_groups)
    return [float(v) for v in torch.where(n > 0, s / n.clamp_min(1), torch.full_like(s, math.nan))]


def _rescore(model: TinyLM, prompts: Tensor, tokens: Tensor, temperature: float) -> Tensor:
    """``[B, L, V]`` fp32 probabilities the sampler copy ``model`` assigns at each answer position (full
    vocabulary, after temperature, before any top-p filter)."""
    with torch.no_grad():
        seq = torch.cat([prompts, tokens], dim=1)
        logits = model(seq[:, :-1])[:, prompts.shape[1] - 1:].float()
        return torch.softmax(logits / temperature, dim=-1)
