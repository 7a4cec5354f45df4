"""``offpolicy diagnose``: before training on a sampler's records, check what they mean and how far they are.

    from offpolicy.diagnose import diagnose, load_rollouts
    report = diagnose(load_rollouts("rollouts.jsonl"), model="path/to/trainer")   # or trainer_logprobs=...
    report.print(); report.save("diagnose_out")       # report.md, report.json, PNG plots
    report.mistakes                                   # e.g. ["raw_logprobs"]; empty when the record looks right
    report.correction                                 # the op.Correction to start from (None: fix the record)

Why is ``r != 1``: ``attribute(rollouts, model=..., current_version=..., weights=..., formats=..., replay=...)``
splits the mismatch into semantics, staleness, weight format, routing and residual (Shapley values;
:mod:`offpolicy.diagnose.attribution`).

Command line: ``offpolicy diagnose ROLLOUTS (--trainer-logprobs FILE | --model DIR) [--out DIR] [--attribute ...]``
(``offpolicy diagnose --help``). See docs/diagnose.md.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from offpolicy.diagnose.attribution import AttributionReport, attribute
from offpolicy.diagnose.divergence import Divergence, divergence, split
from offpolicy.diagnose.findings import Finding
from offpolicy.diagnose.recommend import recommend
from offpolicy.diagnose.recorded import (
    RecordedRollouts,
    from_lines,
    from_token_batch,
    load_rollouts,
    save_jsonl,
    save_safetensors,
    turn_to_json,
)
from offpolicy.diagnose.entries import padded_to_entries
from offpolicy.diagnose.route_file import SequenceRoutes, engine_routes, load_routes, save_engine_routes, save_routes
from offpolicy.diagnose.schema import MAX_INDEX, RolloutsError
from offpolicy.diagnose.scoring import (
    TrainerScores,
    check_trainer_values,
    load_model,
    load_trainer_logprobs,
    score_model,
)
from offpolicy.diagnose.record_checks import record_checks
from offpolicy.diagnose.semantics import (
    best_reading,
    effective_temperature,
    one_sided_ratios,
    shifted_logprobs,
    support_truncation,
)
from offpolicy.diagnose.slices import EXPLAINING, per_slice
from offpolicy.diagnose.summary import DiagnoseReport

__all__ = [
    "AttributionReport", "attribute", "DiagnoseReport", "Divergence", "Finding", "RecordedRollouts", "RolloutsError", "TrainerScores", "diagnose",
    "from_lines",
    "from_token_batch", "load_rollouts", "load_trainer_logprobs", "save_jsonl", "save_safetensors", "turn_to_json",
    "SequenceRoutes", "engine_routes", "load_routes", "save_engine_routes", "save_routes",
]


def diagnose(
    rollouts: RecordedRollouts,
    *,
    trainer_logprobs: TrainerScores | Tensor | None = None,
    model: torch.nn.Module | str | Path | None = None,
    current_version: int | None = None,
    semantics: str = "vllm",
    out_dir: str | Path | None = None,
) -> DiagnoseReport:
    """Compare recorded rollouts with the trainer and check the record's semantics.

    Args:
        rollouts: the sampler's records (:func:`load_rollouts`).
        trainer_logprobs: the trainer's ``log p(y)`` ``[N]`` for the same tokens (at the declared temperature,
            support-renormalised for support records), or :class:`TrainerScores` with candidate log-probs.
        model: instead, a causal LM (or a local ``transformers`` directory) that diagnose evaluates itself; this
            also enables the per-reading fit (raw, temperature twice, not renormalised, best temperature).
        current_version: the trainer's weight version (staleness = current - version); default the newest
            recorded version.
        semantics: the engine's top-k/top-p order for recomputation (``"vllm"`` or ``"sglang"``).
        out_dir: if given, write ``report.md``, ``report.json``, ``ratio_hist.png`` and ``kl_by_staleness.png``.
    """
    if (trainer_logprobs is None) == (model is None):
        raise ValueError("diagnose: pass exactly one of trainer_logprobs= or model=")
    if not isinstance(rollouts, RecordedRollouts):
        raise TypeError(f"diagnose: rollouts must be RecordedRollouts (load_rollouts), got {type(rollouts).__name__}")
    if current_version is not None and (type(current_version) is not int or not 0 <= current_version < MAX_INDEX):
        raise ValueError(f"diagnose: current_version must be an integer in [0, 2^62), got {current_version!r}")
    if model is not None:
        net = load_model(model) if isinstance(model, (str, Path)) else model
        scores = score_model(net, rollouts, semantics=semantics)
    else:
        scores = _trainer_scores(trainer_logprobs, rollouts)
    log_ratio = scores.logprobs - rollouts.sampler_logprobs.double()
    known = rollouts.versions >= 0
    current = current_version if current_version is not None else (
        int(rollouts.versions[known].max()) if bool(known.any()) else None)
    by_staleness = split(log_ratio[known], current - rollouts.versions[known]) if current is not None else {}
    by_group = {rollouts.group_names[g]: d for g, d in split(log_ratio, rollouts.group_index).items()}
    findings = record_checks(rollouts)
    if current is not None and bool((rollouts.versions[known] > current).any()):
        findings.append(Finding("versions_future", False, f"versions newer than the trainer's ({current}) were "
                                "recorded", "versions_backwards", {"current_version": current}))
    shift = shifted_logprobs(rollouts, scores)
    if shift is not None:
        findings.append(shift)
    cause = next((f.mistake for f in findings if not f.ok and f.mistake in EXPLAINING), None)
    findings += per_slice(rollouts, scores, log_ratio, [
        lambda r, s, lr: effective_temperature(r, s), lambda r, s, lr: best_reading(r, s),
        lambda r, s, lr: support_truncation(r, s), lambda r, s, lr: one_sided_ratios(r, lr)], explained_by=cause)
    overall = divergence(log_ratio)
    mistakes = [f.mistake for f in findings if not f.ok and f.mistake]
    kind = rollouts.candidates.kind if rollouts.candidates is not None else None
    correction, reasons = recommend(overall, by_staleness, kind, mistakes)
    report = DiagnoseReport(overall, by_group, by_staleness, findings, correction, reasons, kind, current)
    if out_dir is not None:
        from offpolicy.diagnose.plots import kl_by_staleness, ratio_histograms

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        plots = [str(ratio_histograms(log_ratio, rollouts.group_index, rollouts.group_names, out / "ratio_hist.png"))]
        if by_staleness:
            plots.append(str(kl_by_staleness(by_staleness, out / "kl_by_staleness.png")))
        report.plots.extend(plots)
        report.save(out)
    return report


def _trainer_scores(trainer: TrainerScores | Tensor, rollouts: RecordedRollouts) -> TrainerScores:
    """The trainer's values checked against the record once: ``logprobs [N]`` (float, no NaN, nothing above 0)
    and candidate log-probs as ``[nnz]`` entries of the record's CSR rows (``[N, K]`` read in the layout of
    ``candidates.to_padded()``)."""
    if isinstance(trainer, TrainerScores):
        lp, cand, hyp = trainer.logprobs, trainer.candidate_logprobs, trainer.hypotheses
    else:
        lp, cand, hyp = trainer, None, None
    if not isinstance(lp, Tensor):
        lp = torch.as_tensor(lp, dtype=torch.float64)
    lp = check_trainer_values(lp, "trainer logprobs").flatten()
    if lp.shape[0] != len(rollouts):
        raise ValueError(f"diagnose: {lp.shape[0]} trainer log-probs for {len(rollouts)} tokens")
    if cand is not None:
        if rollouts.candidates is None:
            raise ValueError("diagnose: trainer candidate_logprobs given for a record without candidates")
        cand = padded_to_entries(check_trainer_values(cand, "trainer candidate_logprobs"), rollouts.candidates,
                                 "trainer candidate_logprobs")
    return TrainerScores(lp, cand, hyp)
