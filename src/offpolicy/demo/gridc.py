"""Grid C (issue 45, docs/demo_gridC_registration.md): numerics alone, with a mixture-of-experts policy whose routes
the quantised samplers flip.

The grid's settings are data here, fixed by the registration before any grid-C history existed; ``offpolicy demo
--grid C`` runs them seed by seed (one file per finished seed, so an interrupted grid resumes at the first missing
seed), and ``offpolicy demo --grid C --calibrate`` measures what the registration was calibrated from.

Per seed (:func:`configs_for_seed`), every run at staleness 0 unless tagged ``st4``:

* the on-policy controls: ``grpo@onpolicy`` (full distribution) and ``grpo_topp@onpolicy`` (top-p with mask replay,
  the control of the top-p arms, scored under its nucleus);
* every grid-C arm on the mixed fleet at the primary format (:data:`PRIMARY_FORMAT`);
* the dose-response arms (:data:`SWEEP_ARMS`) at the other formats of :data:`FORMATS`;
* ``grpo@homogeneous``;
* the staleness-4 contrast (tag ``st4``): GRPO at the primary format and on the homogeneous fleet.
"""

from __future__ import annotations

from dataclasses import replace

from offpolicy.demo.model import ModelConfig
from offpolicy.demo.task import SortTask
from offpolicy.demo.train import RunConfig

#: The task: grid B's scratchpad variant (12 numbers, 256 ids, 4 unscored scratchpad tokens).
TASK = dict(n_items=12, max_value=32, vocab=256, scratch=4)
#: The policy: grid A/B's shape with each MLP split into 4 experts (top-2), the same expert parameters in total.
MODEL = dict(d_model=64, n_layers=2, n_heads=4, d_ff=256, n_experts=4, top_k=2)
#: The samplers' weight formats, in increasing mismatch (each mixed fleet serves one of them).
FORMATS = ("bf16", "fp8", "nvfp4", "mxfp4")
#: The format at which every arm runs (the study's NVFP4).
PRIMARY_FORMAT = "nvfp4"
#: Arms on the mixed fleet at the primary format.
ARMS_C = ("grpo", "grpo_mis", "sc", "sc_mis", "sc_mis_topp", "sc_mis_topp_rr", "rr_tis")
#: Arms of the format sweep.
SWEEP_ARMS = ("grpo", "rr_tis")
#: Staleness of the contrast runs (tag ``st4``).
CONTRAST_STALENESS = 4.0

#: Run settings registered for grid C (docs/demo_gridC_registration.md); the calibration
#: (docs/demo_results/gridC_calibration/) chose ``steps`` (GRPO at NVFP4 below the control by 0.020 in ``Y`` at 200
#: steps, one seed), ``grad_clip`` (binds on 0.7 % of the calibration's unclipped steps) and ``mis_bounds`` (the
#: narrowest candidate band masking under 0.5 % of sampled tokens at NVFP4: 0.3 %, against 1.0 % for [0.5, 5]).
SETTINGS = dict(steps=200, prompts=16, samples=8, lr=1e-4, grad_clip=4.0, top_p=0.95, head_k=8, staleness=0.0,
                eval_every=50, eval_prompts=128, eval_samples=4, pass_k=2, mis_bounds=(0.2, 5.0))


def task() -> SortTask:
    return SortTask(**TASK)


def model_config(t: SortTask | None = None) -> ModelConfig:
    t = t or task()
    return ModelConfig(vocab_size=t.vocab_size, max_len=t.seq_len, **MODEL)


def base_config(**overrides) -> RunConfig:
    """Grid C's shared run settings (arm, fleet and seed set per run); ``overrides`` for tests and calibration."""
    return RunConfig(arm="grpo", fleet="onpolicy", **dict(SETTINGS, **overrides))


def configs_for_seed(base: RunConfig, seed: int) -> list[RunConfig]:
    """Every run of one seed, in a fixed order (see the module docstring)."""
    runs = [("grpo", "onpolicy", "seed", 0.0, ""), ("grpo_topp", "onpolicy", "seed", 0.0, "")]
    runs += [(a, "mixed", PRIMARY_FORMAT, 0.0, "") for a in ARMS_C]
    runs += [(a, "mixed", f, 0.0, "") for f in FORMATS if f != PRIMARY_FORMAT for a in SWEEP_ARMS]
    runs += [("grpo", "homogeneous", "seed", 0.0, "")]
    runs += [(a, fl, f, CONTRAST_STALENESS, "st4") for a, fl, f in
             (("grpo", "mixed", PRIMARY_FORMAT), ("grpo", "homogeneous", "seed"))]
    return [replace(base, arm=a, fleet=fl, weight_format=f, staleness=st, tag=tag, seed=seed)
            for a, fl, f, st, tag in runs]


#: Candidate MIS bands whose masked share the calibration measures.
CANDIDATE_BANDS = ((0.5, 5.0), (0.2, 5.0), (0.1, 10.0))


def calibration_text(numerics: list[dict], runs: list[dict]) -> str:
    """The calibration's markdown: numerics per fleet at the warm-up weights (KL, |log r|, route flips, masked share
    per candidate band), and per calibration run the exact held-out success at each evaluation, the pre-clip
    gradient norm's quantiles and the route-flip share."""
    from offpolicy.demo.report import markdown_table

    cols = [("config", "fleet (staleness 0)"), ("kl", "KL(q||p) per token"), ("abs_log_ratio", "mean |log r|"),
            ("route_flip", "route-flip share"), ("tv", "TV"),
            *((f"masked {lo:g}-{hi:g}", f"outside [{lo:g}, {hi:g}]") for lo, hi in CANDIDATE_BANDS)]
    text = ("Numerics at the warm-up weights (each fleet's groups sample held-out prompts; capacity-weighted):\n\n"
            + markdown_table([r for r in numerics if r["group"] == "(fleet)"], cols))
    if runs:
        rows = []
        for r in runs:
            norms = sorted(h["grad_norm_preclip"] for h in r["history"])
            q = lambda f: norms[min(len(norms) - 1, int(f * len(norms)))]  # noqa: E731
            flips = [h["route_flip"] for h in r["history"]]
            rows.append({"run": r["run_id"], "steps": len(r["history"]),
                         "success": " ".join(f"{e['step']}:{e['success_exact']:.3f}" for e in r["evals"]),
                         "grad_p50": q(0.5), "grad_p95": q(0.95), "grad_max": norms[-1],
                         "route_flip": sum(flips) / len(flips),
                         "kl": sum(h["kl_full"] for h in r["history"]) / len(r["history"])})
        text += ("\n\nCalibration runs (exact held-out success at each evaluation, step:value):\n\n"
                 + markdown_table(rows, [("run", "run"), ("steps", "steps"), ("success", "exact success"),
                                         ("grad_p50", "grad norm p50"), ("grad_p95", "p95"), ("grad_max", "max"),
                                         ("route_flip", "route-flip share"), ("kl", "mean KL(q||p)")]))
    return text + "\n"
