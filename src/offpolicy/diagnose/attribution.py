"""Why is ``r != 1``? Split each recorded token's mismatch ``log q - log p`` into named causes by re-scoring it
with the trainer's model under controlled changes, one cause each, and share the parts out with Shapley values.

    from offpolicy.diagnose.attribution import attribute
    rep = attribute(rollouts, model=trainer, current_version=12, weights={10: m10, 11: m11},
                    formats=fleet_groups, replay=my_replay)          # replay: optional, MoE routing
    rep.print(); rep.save("diagnose_out")          # attribution.md, attribution.json, attribution.png

Causes (each a switch from the trainer's side to the sampler's, applied to the trainer's own model):

* ``staleness``: the weights of the version the sampler served (``weights[version]``) instead of the current ones;
* ``format``: those weights rounded through the sampler group's weight format (FP8 / NVFP4 / MXFP4 / BF16, with
  :func:`offpolicy.fleet.quant.fake_quantize_module`) instead of unquantised;
* ``routing`` (mixture of experts): the forward with the sampler's recorded routes replayed (``replay(model,
  batch)``, a pluggable callable) instead of the model's own routing;
* ``residual``: what the three leave, ``lq - log p_all`` (kernels, batch layout, KV-cache precision); its
  batch-layout part is measured apart, by re-scoring the same tokens under two batch layouts;
* ``semantics``: a mis-read record (raw log-probs, temperature twice, no renormalisation, base 2), found by the
  diagnose readings against the *reconstructed sampler* (all causes on); it is reported and measured as
  ``log q_reading - log q_declared`` of that reconstruction, and peeled off before the split, never Shapley-split
  (a record error is applied to the sampler's output, after every physical cause).

Order independence: the causes interact (a stale NVFP4 group's staleness share depends on whether it is measured
before or after the format), so each part is the **Shapley value** over the players ``staleness``, ``format``,
``routing``, ``residual``: every subset ``S`` of the three causes is one re-score ``log p_S`` (``2^c`` for the
``c`` causes that apply; subsets shared between cells are scored once), the residual enters additively, and a
part is its marginal contribution averaged over all orders. Per token the parts sum to ``log q - log p``
exactly; for each reported metric (mean ``|log r|``, k3, tokens outside the MIS band ``[0.5, 5]``) the Shapley
values of the metric's own game sum to the metric (efficiency), so shares add to 100%.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from offpolicy.diagnose.findings import Finding, short_label
from offpolicy.diagnose.record_checks import record_checks
from offpolicy.diagnose.recorded import RecordedRollouts
from offpolicy.diagnose.scoring import _filtered, _tempered, support_of
from offpolicy.diagnose.semantics import ERROR_RATIO, LN2, MIN_ERROR, declared_temperature
from offpolicy.diagnose.slices import EXPLAINING, slice_indices, take
from offpolicy.diagnose.summary import finite_json
from offpolicy.fleet.groups import SamplerGroup
from offpolicy.fleet.quant.fake import FAKE_FORMATS, fake_quantize_module

#: the causes re-scored in the Shapley game, in the bit order of a coalition mask (bit i: CAUSES[i])
CAUSES = ("staleness", "format", "routing")
#: the Shapley players: the causes and the additive residual
PLAYERS = CAUSES + ("residual",)
#: every reported part (semantics is peeled off first, never Shapley-split)
PARTS = ("semantics",) + PLAYERS
#: IcePop / weights="mis" band on r = p / q (docs/spec.md#weights), inclusive
MIS_BAND = (0.5, 5.0)
#: formats that leave the weights as they are (the format cause does not apply)
IDENTITY_FORMATS = ("fp32", "none")
#: readings of the record tried against the reconstructed sampler: reading -> mistake name
READINGS = {"raw": "raw_logprobs", "temperature_twice": "temperature_twice",
            "not_renormalised": "missing_renormalisation", "log_base_2": "log_base_2"}
#: below this mean |log r| (nats) a slice has no mismatch worth a recommendation
NEGLIGIBLE = 1e-4


@dataclass(frozen=True)
class ScoreBatch:
    """What a re-scorer is handed: ``b`` recorded sequences.

    Attributes:
        input_ids: ``[b, L]`` int64, right-padded with 0 to the longest of the ``b``.
        lengths: ``[b]`` int64 valid length of each row.
        rows: ``[b]`` int64 the sequences' indices in ``rollouts.contexts`` (a routing replay looks its recorded
            routes up by them).
    """

    input_ids: Tensor
    lengths: Tensor
    rows: Tensor


#: ``(model, batch) -> [b, L, V]`` logits (or full-vocabulary log-probs: the tempered log-softmax of either is the
#: same) of ``model``'s forward on ``batch``. ``replay`` gives it with the sampler's routes forced.
Rescorer = Callable[[nn.Module, ScoreBatch], Tensor]


def own_routing(model: nn.Module, batch: ScoreBatch) -> Tensor:
    """The plain forward (the model's own routing): ``model(input_ids)`` (a tensor or ``.logits``)."""
    out = model(batch.input_ids)
    return out.logits if hasattr(out, "logits") else out


# --------------------------------------------------------------------------------------------------- Shapley


def shapley_matrix(n: int) -> Tensor:
    """``[2^n, n]`` float64 ``M`` with ``phi = values @ M`` the Shapley values of a game given by its coalition
    values ``values [..., 2^n]`` (bit ``i`` of the index: player ``i`` in the coalition):
    ``phi_i = sum_{S not containing i} |S|! (n - |S| - 1)! / n! (v(S + i) - v(S))``."""
    m = torch.zeros(1 << n, n, dtype=torch.float64)
    for mask in range(1 << n):
        s = bin(mask).count("1")
        for i in range(n):
            if not mask >> i & 1:
                w = math.factorial(s) * math.factorial(n - s - 1) / math.factorial(n)
                m[mask | 1 << i, i] += w
                m[mask, i] -= w
    return m


_SHAPLEY = shapley_matrix(len(PLAYERS))


def _metrics(delta: Tensor) -> Tensor:
    """``[..., 3]`` float64 (mean ``|log r|``, k3, tokens outside the MIS band) of mismatches ``delta [..., n]``
    (``log q - log p``, so ``log r = -delta``)."""
    lr = -delta
    lo, hi = math.log(MIS_BAND[0]), math.log(MIS_BAND[1])
    k3 = torch.exp(lr.clamp(max=50.0)) - 1 - lr
    return torch.stack([lr.abs().mean(-1), k3.mean(-1), ((lr < lo) | (lr > hi)).double().sum(-1)], -1)


METRICS = ("mean_abs_log_r", "k3", "outside_band")


# --------------------------------------------------------------------------------------------------- report


@dataclass(frozen=True)
class SliceAttribution:
    """One reported slice: ``kind`` ``"all"``, ``"group"``, ``"format"``, ``"staleness"`` or
    ``"group_staleness"``.

    ``total``: ``{metric: value}`` observed on the slice's sampled tokens (:data:`METRICS`; ``outside_band`` a
    count) and ``non_finite``, the tokens left out because a re-score gave ``log p = -inf``. ``parts``: ``{part: {metric: Shapley value, "share_" + metric: value / total, "mean": mean signed
    part of log q - log p}}`` for :data:`PARTS`. ``mistakes``: semantic mistakes named on its tokens.
    """

    kind: str
    label: str
    group: str | None
    format: str | None
    staleness: str | None
    tokens: int
    total: dict[str, float]
    parts: dict[str, dict[str, float]]
    mistakes: list[str]
    recommendation: str

    def as_dict(self) -> dict:
        return {"kind": self.kind, "label": self.label, "group": self.group, "format": self.format,
                "staleness": self.staleness, "tokens": self.tokens, "total": self.total, "parts": self.parts,
                "mistakes": self.mistakes, "recommendation": self.recommendation}


@dataclass
class AttributionReport:
    """What :func:`attribute` measured.

    Attributes:
        slices: :class:`SliceAttribution` for all sampled tokens, each group, each format, each staleness bucket
            and each group x staleness bucket.
        findings: semantic findings (record checks and the readings against the reconstructed sampler).
        token_index: ``[n]`` int64 the sampled tokens (indices into the rollouts).
        coalitions: ``[n, 2^3]`` float64 ``log p_S - log p_{}`` for each subset ``S`` of :data:`CAUSES` (bit
            ``i``: ``CAUSES[i]`` on); a cause that does not apply to a token leaves its values unchanged.
        residual, semantics: ``[n]`` float64 the residual ``lq - log q_reading`` and the semantic part.
        per_token: ``[n, 5]`` float64 per-token parts in :data:`PARTS` order; rows sum to ``log q - log p``.
        layout: ``{"mean_abs": ..., "max_abs": ...}`` ``|log p|`` moved by the second batch layout.
        causes: the causes measured (``routing`` only with a replay).
        cost: re-scores, token evaluations, forward passes, seconds, and their rate per 10k tokens.
        step: the training step (for a run's history), or ``None``.
    """

    slices: list[SliceAttribution]
    findings: list[Finding]
    token_index: Tensor
    coalitions: Tensor
    residual: Tensor
    semantics: Tensor
    per_token: Tensor
    layout: dict[str, float]
    causes: list[str]
    cost: dict[str, float]
    step: int | None = None
    plots: list[str] = field(default_factory=list)

    METHOD = ("Shapley values over the players staleness, format, routing, residual (order-independent: each "
              "part is its marginal contribution averaged over all orders; one re-score per subset of the causes, "
              "2^c for c causes; the residual enters additively); semantics (a mis-read record) is peeled off "
              "first, measured on the reconstructed sampler, and not Shapley-split")

    @property
    def mistakes(self) -> list[str]:
        return sorted({f.mistake for f in self.findings if not f.ok and f.mistake})

    def slice(self, kind: str, label: str | None = None) -> SliceAttribution:
        """The slice of ``kind`` (and ``label``: a group name, a format, a staleness bucket)."""
        for s in self.slices:
            if s.kind == kind and (label is None or s.label == label):
                return s
        raise KeyError(f"no {kind} slice {label!r}; have {[(s.kind, s.label) for s in self.slices]}")

    def as_dict(self) -> dict:
        return {"method": self.METHOD, "mis_band": list(MIS_BAND), "causes": self.causes, "step": self.step,
                "mistakes": self.mistakes, "layout": self.layout, "cost": self.cost,
                "slices": [s.as_dict() for s in self.slices],
                "findings": [{"check": f.check, "ok": f.ok, "mistake": f.mistake, "message": f.message,
                              "evidence": f.evidence} for f in self.findings], "plots": self.plots}

    def json(self) -> str:
        import json

        return json.dumps(finite_json(self.as_dict()), indent=1, allow_nan=False)

    def _table(self, kinds: Sequence[str]) -> list[str]:
        head = "| slice | tokens | mean abs log r | k3 | outside [0.5, 5] | " + " | ".join(PARTS) + " | recommendation |"
        out = [head, "|---|---:|---:|---:|---:|" + "---:|" * len(PARTS) + "---|"]
        for s in self.slices:
            if s.kind not in kinds:
                continue
            cells = []
            for p in PARTS:
                v = s.parts[p]
                cells.append(f"{v['share_mean_abs_log_r']:.0%} / {v['share_k3']:.0%} / {v['outside_band']:.1f}"
                             if math.isfinite(v["share_mean_abs_log_r"]) else "-")
            where = "all tokens" if s.kind == "all" else f"{s.kind.replace('_', ' x ')} {short_label(s.label)}"
            out.append(f"| {where.replace('|', '/')} | {s.tokens} | {s.total['mean_abs_log_r']:.4f} | "
                       f"{s.total['k3']:.5f} | {int(s.total['outside_band'])} | " + " | ".join(cells)
                       + f" | {s.recommendation.replace('|', chr(92) + '|')} |")
        return out

    def markdown(self) -> str:
        out = ["# offpolicy diagnose --attribute: why is r != 1?", "", f"**Method:** {self.METHOD}.", "",
               f"Causes measured: {', '.join(self.causes)}. Each part cell: share of mean |log r| / share of the "
               "KL (k3) / tokens it moves outside the MIS band [0.5, 5] (Shapley, so fractional).", ""]
        out += self._table(("all", "group", "format", "staleness", "group_staleness"))
        out += ["", f"Batch layout (part of the residual): mean |delta log p| between two layouts "
                f"{self.layout['mean_abs']:.3g} (max {self.layout['max_abs']:.3g}).", "",
                "## Semantics", ""]
        out += [f"- [{'XX' if not f.ok else 'ok'}] {f.check}{' **' + f.mistake + '**' if f.mistake else ''}: "
                f"{f.message}" for f in self.findings] or ["- none"]
        c = self.cost
        out += ["", "## Cost", "", f"{int(c['tokens'])} tokens, {int(c['rescores'])} re-scores "
                f"({int(c['token_evaluations'])} token evaluations, {int(c['forward_passes'])} forward passes) in "
                f"{c['seconds']:.2f} s; per 10k tokens: {c['seconds_per_10k_tokens']:.1f} s and "
                f"{c['rescores_per_10k_tokens']:.0f} token re-scores ({c['token_evaluations_per_token']:.2f} per "
                "token)."]
        if self.plots:
            out += ["", "## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in self.plots]
        return "\n".join(out) + "\n"

    def text(self) -> str:
        lines = ["offpolicy diagnose --attribute (Shapley over " + ", ".join(self.causes) + ", residual; "
                 "shares of mean |log r|)", "",
                 f"{'slice':<34}{'tokens':>7}{'|log r|':>9}" + "".join(f"{p[:9]:>10}" for p in PARTS)]
        for s in self.slices:
            if s.kind in ("all", "group", "group_staleness"):
                name = (s.label if s.kind == "all" else f"{short_label(s.group or '', 24)} @ stale {s.staleness}"
                        if s.kind == "group_staleness" else short_label(s.label, 33))
                lines.append(f"{name[:33]:<34}{s.tokens:>7}"
                             f"{s.total['mean_abs_log_r']:>9.4f}"
                             + "".join(f"{s.parts[p]['share_mean_abs_log_r']:>10.0%}" for p in PARTS))
        lines += ["", "recommendations:"]
        lines += [f"  {s.label}: {s.recommendation}" for s in self.slices if s.kind == "group"]
        lines += [f"  [{'XX' if not f.ok else 'ok'}] {f.check}: {f.message}" for f in self.findings if not f.ok]
        c = self.cost
        lines += ["", f"cost per 10k tokens: {c['seconds_per_10k_tokens']:.1f} s, {c['rescores_per_10k_tokens']:.0f} "
                  f"token re-scores ({c['token_evaluations_per_token']:.2f} per token; {int(c['tokens'])} tokens "
                  f"in {c['seconds']:.2f} s)"]
        return "\n".join(lines)

    def print(self, stream=None) -> None:
        import sys

        print(self.text(), file=sys.stdout if stream is None else stream)

    def save(self, out_dir: str | Path, history: Sequence["AttributionReport | dict"] = ()) -> Path:
        """Write ``attribution.md``, ``attribution.json`` and ``attribution.png`` (stacked bars per group) to
        ``out_dir``, and ``attribution_history.png`` (parts over training steps) when ``history`` (earlier
        reports, or their JSON dicts, each with a ``step``) is given. Returns the markdown path."""
        from offpolicy.diagnose.plots import attribution_bars, attribution_history

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.plots = [str(attribution_bars(self, out / "attribution.png", PARTS))]
        if history:
            self.plots.append(str(attribution_history([*history, self], out / "attribution_history.png", PARTS)))
        (out / "attribution.json").write_text(self.json() + "\n")
        path = out / "attribution.md"
        path.write_text(self.markdown())
        return path


# --------------------------------------------------------------------------------------------------- inputs


def _formats(formats: Mapping[str, str] | Sequence[SamplerGroup], names: tuple[str, ...]
             ) -> tuple[dict[str, str], dict[str, str]]:
    """``({group: weight format}, {group: kv format})`` for every recorded group; raises ``ValueError`` naming
    ``formats`` (``--group-format``) for a missing group or an unknown format."""
    if isinstance(formats, Mapping):
        fmt, kv = dict(formats), {}
    else:
        groups = list(formats)
        if not all(isinstance(g, SamplerGroup) for g in groups):
            raise ValueError("attribute: formats must map group name -> weight format, or be SamplerGroups")
        fmt = {g.name: g.weight_format for g in groups}
        kv = {g.name: g.kv_format for g in groups}
    missing = [g for g in names if g not in fmt]
    if missing:
        raise ValueError(f"--group-format: no weight format given for recorded group(s) {missing} (pass "
                         f"--group-format NAME=FORMAT, FORMAT one of {FAKE_FORMATS})")
    bad = {g: f for g, f in fmt.items() if f not in FAKE_FORMATS}
    if bad:
        raise ValueError(f"--group-format: unknown weight format(s) {bad}; one of {FAKE_FORMATS}")
    return {g: fmt[g] for g in names}, kv


def check_plan(rollouts: RecordedRollouts, current_version: int, versions: Sequence[int] | Mapping[int, object],
               formats: Mapping[str, str] | Sequence[SamplerGroup]) -> tuple[dict[str, str], dict[str, str]]:
    """Check, before any model is loaded, that every recorded version other than the current one has weights
    (``versions``) and every recorded group a format; returns ``({group: format}, {group: kv format})``. Raises
    ``ValueError`` naming ``--version-weights`` or ``--group-format``."""
    held = sorted(set(torch.unique(rollouts.versions).tolist()) - {-1, current_version})
    missing = [v for v in held if v not in versions]
    if missing:
        raise ValueError(f"--version-weights: the record holds tokens of version(s) {missing} but no weights were "
                         f"given for them (pass --version-weights VERSION=DIR for each; current version "
                         f"{current_version})")
    return _formats(formats, rollouts.group_names)


def _sample(rollouts: RecordedRollouts, max_tokens: int, seed: int) -> Tensor:
    """Sorted token indices: all when ``N <= max_tokens``, else a seeded sample proportional per group, with at
    least ``min(n_g, 32)`` tokens of each group."""
    n = len(rollouts)
    if n <= max_tokens:
        return torch.arange(n)
    g = torch.Generator().manual_seed(seed)
    out = []
    for gi in torch.unique(rollouts.group_index).tolist():
        idx = (rollouts.group_index == gi).nonzero().flatten()
        want = min(idx.numel(), max(math.ceil(max_tokens * idx.numel() / n), 32))
        out.append(idx[torch.randperm(idx.numel(), generator=g)[:want]])
    return torch.sort(torch.cat(out)).values


def staleness_bucket(s: int | None) -> str:
    """``"0"``, ``"1"``, ``"2-3"``, ``"4-7"``, ... (powers of two); ``"unknown"`` for ``None``; ``"ahead"`` below 0."""
    if s is None:
        return "unknown"
    if s < 0:
        return "ahead"
    if s < 2:
        return str(s)
    lo = 1 << (s.bit_length() - 1)
    return f"{lo}-{2 * lo - 1}"


# --------------------------------------------------------------------------------------------------- scoring


class _Scorer:
    """Re-scores sampled tokens under a configuration ``(version, format, replay)``; counts its cost."""

    def __init__(self, sub: RecordedRollouts, model: nn.Module, weights: Mapping[int, nn.Module],
                 current: int, replay: Rescorer | None, chunk: int, semantics: str, quantize_skip: tuple[str, ...]):
        self.sub, self.model, self.weights, self.current = sub, model, weights, current
        self.replay, self.chunk, self.semantics, self.skip = replay, chunk, semantics, quantize_skip
        self._models: dict[tuple[int, str | None], nn.Module] = {}
        self.rescores = self.evaluations = self.passes = 0

    def variant(self, version: int, fmt: str | None) -> nn.Module:
        key = (version, fmt)
        if key not in self._models:
            self._models.clear()  # configurations come sorted by (version, format): one quantised copy at a time
            base = self.model if version == self.current else self.weights[version]
            self._models[key] = base if fmt is None else fake_quantize_module(base, fmt, skip=self.skip)
        return self._models[key]

    def score(self, idx: Tensor, version: int, fmt: str | None, routed: bool, layout: str = "chunks",
              readings: bool = False) -> dict[str, Tensor]:
        """``{"declared": [n]}`` float64 trainer log-probs of tokens ``idx`` of the sample (and with
        ``readings`` the mistaken readings of :data:`READINGS` plus ``"declared_filter"``)."""
        net = self.variant(version, fmt)
        was = net.training
        net.eval()
        try:
            return self._score(net, idx, routed, layout, readings)
        finally:
            net.train(was)

    def _score(self, net: nn.Module, idx: Tensor, routed: bool, layout: str, readings: bool) -> dict[str, Tensor]:
        r = self.sub
        fwd = self.replay if routed else own_routing
        out = {k: torch.empty(idx.numel(), dtype=torch.float64)
               for k in (("declared", "declared_filter", *READINGS) if readings else ("declared",))}
        rows = torch.unique(r.rows[idx])
        if layout == "single":  # the second layout: one sequence at a time, in reverse order
            groups = [rows[i: i + 1] for i in range(rows.numel() - 1, -1, -1)]
        else:
            groups = [rows[i: i + self.chunk] for i in range(0, rows.numel(), self.chunk)]
        self.rescores += 1
        self.evaluations += idx.numel()
        lengths = r.contexts.lengths
        for grp in groups:
            width = int(lengths[grp].max())
            ids = torch.zeros(grp.numel(), width, dtype=torch.int64)
            for j, b in enumerate(grp.tolist()):
                o = int(r.contexts.offsets[b])
                ids[j, : int(lengths[b])] = r.contexts.ids[o: o + int(lengths[b])]
            batch = ScoreBatch(ids, lengths[grp].clone(), grp.clone())
            with torch.no_grad():
                logits = fwd(net, batch)
            self.passes += 1
            if not isinstance(logits, Tensor) or logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(ids.shape):
                raise ValueError(f"attribute: the {'replay' if routed else 'model'} forward returned "
                                 f"{list(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__} "
                                 f"for input [b, L] = {list(ids.shape)}; expected logits [b, L, V]")
            here = torch.isin(r.rows[idx], grp).nonzero().flatten()
            tok = idx[here]
            local = torch.searchsorted(grp, r.rows[tok]) if layout != "single" else torch.zeros_like(tok)
            z = logits[local, r.cols[tok] - 1].double()
            for k, v in self._token_logprobs(z, tok, readings).items():
                out[k][here] = v
        return out

    def _token_logprobs(self, z: Tensor, tok: Tensor, readings: bool) -> dict[str, Tensor]:
        """score_model's convention: tempered at the declared T, renormalised over the recorded support (support
        records) or the declared filter's kept set (filtered tokens)."""
        r = self.sub
        y = r.tokens[tok][:, None]
        vocab = z.shape[-1]
        if int(y.max()) >= vocab:
            raise ValueError(f"attribute: recorded token id {int(y.max())} is outside the model's vocabulary {vocab}")
        t, p, k = r.temperature[tok].double(), r.top_p[tok], r.top_k[tok]
        filt = (p < 1.0) | (k >= 0)
        lt = _tempered(z, t)
        renorm = _filtered(lt, p, k, self.semantics)
        declared_filter = torch.where(filt, renorm.gather(1, y)[:, 0], lt.gather(1, y)[:, 0])
        c = r.candidates
        if c is not None and c.kind == "support":
            rows = c.take_rows(tok)
            local = rows.row_index()
            sub = torch.where(support_of(local, rows.ids.long(), tok.numel(), vocab), lt, float("-inf"))
            declared = (sub - torch.logsumexp(sub, -1, keepdim=True)).gather(1, y)[:, 0]
        else:
            declared = declared_filter
        out = {"declared": declared}
        if readings:
            out["declared_filter"] = declared_filter
            out["raw"] = torch.log_softmax(z, -1).gather(1, y)[:, 0]
            out["temperature_twice"] = _filtered(_tempered(z, t * t), p, k, self.semantics).gather(1, y)[:, 0]
            out["not_renormalised"] = lt.gather(1, y)[:, 0]
            out["log_base_2"] = declared / LN2
        return out


def _reading_findings(sub: RecordedRollouts, hyp: dict[str, Tensor], explained: str | None
                      ) -> tuple[list[Finding], Tensor]:
    """Per diagnose slice, the reading of the record that the reconstructed sampler explains best (the rule of
    :func:`offpolicy.diagnose.semantics.best_reading`: 3-fold better than the declared one, which is off by more
    than 0.02); ``(findings, semantic part [n])`` with ``part = log q_reading - log q_declared``."""
    lq = sub.sampler_logprobs.double()
    part = torch.zeros(len(sub), dtype=torch.float64)
    found: dict[str, list[str]] = {}
    for label, idx in slice_indices(sub):
        err = {k: float((hyp[k][idx] - lq[idx]).abs().nan_to_num(float("inf")).median())
               for k in ("declared_filter", *READINGS)}
        t = declared_temperature(take(sub, idx))
        cands = list(READINGS)
        if not bool(((sub.top_p[idx] < 1.0) | (sub.top_k[idx] >= 0)).any()):
            cands.remove("not_renormalised")
        if abs(t - 1.0) <= 1e-6:
            cands.remove("temperature_twice")
            cands.remove("raw")
        best = min(cands, key=lambda k: err[k])
        if err["declared_filter"] > MIN_ERROR and err[best] * ERROR_RATIO < err["declared_filter"]:
            found.setdefault(best, []).append(label)
            part[idx] = hyp[best][idx] - hyp["declared_filter"][idx]
    out = []
    for reading, labels in found.items():
        mistake = explained or READINGS[reading]
        out.append(Finding("attribution_reading", False,
                           f"[{', '.join(labels[:3])}{' ...' if len(labels) > 3 else ''}] the record matches the "
                           f"reconstructed sampler read as {reading!r}, not as declared"
                           + (f" (explained by {explained})" if explained else ""), mistake,
                           {"slices": len(labels)}))
    if not found:
        out.append(Finding("attribution_reading", True, "the record matches the reconstructed sampler as declared"))
    return out, part


# --------------------------------------------------------------------------------------------------- attribute


def attribute(
    rollouts: RecordedRollouts,
    *,
    model: nn.Module,
    current_version: int,
    weights: Mapping[int, nn.Module] | None = None,
    formats: Mapping[str, str] | Sequence[SamplerGroup],
    replay: Rescorer | None = None,
    max_tokens: int = 4096,
    seed: int = 0,
    chunk: int = 16,
    semantics: str = "vllm",
    quantize_skip: Sequence[str] = (),
    step: int | None = None,
) -> AttributionReport:
    """Attribute the sampler-trainer mismatch ``log q - log p`` of a sample of recorded tokens to its causes.

    Args:
        rollouts: the sampler's records (:func:`offpolicy.diagnose.load_rollouts`).
        model: the trainer's model at ``current_version`` (``input_ids [B, L] -> logits [B, L, V]``).
        current_version: the trainer's weight version.
        weights: ``{version: model}`` the weights of every other version the record holds (tokens of unknown
            version, ``-1``, get no staleness part: it stays in the residual).
        formats: ``{group name: weight format}`` (:data:`offpolicy.fleet.quant.FAKE_FORMATS`) for every recorded
            group, or the fleet's :class:`~offpolicy.fleet.SamplerGroup` list.
        replay: for a mixture of experts, ``(model, ScoreBatch) -> [b, L, V]`` logits with the sampler's recorded
            routes replayed (the routing cause); ``None``: routing is not measured (it stays in the residual).
        max_tokens: tokens sampled for the attribution (all when the record holds fewer).
        seed: the sample's seed.  chunk: sequences per forward in the first batch layout.
        semantics: the engine's filter order (``"vllm"`` or ``"sglang"``).
        quantize_skip: module-name substrings left unquantised (e.g. ``("lm_head",)``).
        step: the training step, for a run's history plot.

    Raises ``ValueError`` naming the argument (and the CLI flag) for a missing version's weights, a group without
    a format, or a model whose forward does not fit the record.
    """
    if not isinstance(rollouts, RecordedRollouts):
        raise TypeError(f"attribute: rollouts must be RecordedRollouts, got {type(rollouts).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"attribute: model must be an nn.Module, got {type(model).__name__}")
    if type(current_version) is not int or current_version < 0:
        raise ValueError(f"--current-version: the trainer's weight version must be an integer >= 0, got "
                         f"{current_version!r}")
    if type(max_tokens) is not int or max_tokens < 1:
        raise ValueError(f"--attribute-tokens: must be an integer >= 1, got {max_tokens!r}")
    weights = dict(weights or {})
    for v, m in weights.items():
        if type(v) is not int or not isinstance(m, nn.Module):
            raise ValueError(f"--version-weights: expected {{int version: model}}, got {v!r}: {type(m).__name__}")
    fmt_of, kv_of = check_plan(rollouts, current_version, weights, formats)
    t0 = time.perf_counter()
    token_index = _sample(rollouts, max_tokens, seed)
    sub = take(rollouts, token_index)
    n = len(sub)
    sc = _Scorer(sub, model, weights, current_version, replay, chunk, semantics, tuple(quantize_skip))
    causes = ["staleness", "format"] + (["routing"] if replay is not None else [])
    # which configuration each coalition of each token needs; tokens that share one are scored together
    gfmt = [fmt_of[g] for g in sub.group_names]
    tok_version = sub.versions.tolist()
    tok_group = sub.group_index.tolist()
    need: dict[tuple[int, str | None, bool], list[tuple[int, int]]] = {}
    for t in range(n):
        v, f = tok_version[t], gfmt[tok_group[t]]
        for mask in range(1 << len(CAUSES)):
            cfg = (v if mask & 1 and v >= 0 else current_version,
                   f if mask & 2 and f not in IDENTITY_FORMATS else None, bool(mask & 4) and replay is not None)
            need.setdefault(cfg, []).append((t, mask))
    coal_lp = torch.empty(n, 1 << len(CAUSES), dtype=torch.float64)
    full = (1 << len(CAUSES)) - 1
    hyp = {k: torch.empty(n, dtype=torch.float64) for k in ("declared_filter", *READINGS)}
    for cfg, pairs in sorted(need.items(), key=lambda kv: (kv[0][0], kv[0][1] or "", kv[0][2])):
        toks = torch.tensor([t for t, _ in pairs])
        uniq, inv = torch.unique(toks, return_inverse=True)
        has_full = any(m == full for _, m in pairs)
        s = sc.score(uniq, *cfg, readings=has_full)
        masks = torch.tensor([m for _, m in pairs])
        coal_lp[toks, masks] = s["declared"][inv]
        if has_full:
            fsel = masks == full
            for k in hyp:
                hyp[k][toks[fsel]] = s[k][inv[fsel]]
    base = coal_lp[:, 0]
    layout_lp = sc.score(torch.arange(n), current_version, None, False, layout="single")["declared"]
    layout = {"mean_abs": float((layout_lp - base).abs().mean()), "max_abs": float((layout_lp - base).abs().max())}
    seconds = time.perf_counter() - t0
    # semantics: the record checks, then the readings against the reconstructed sampler (all causes on)
    findings = record_checks(sub)
    explained = next((f.mistake for f in findings if not f.ok and f.mistake in EXPLAINING), None)
    reading_findings, sem = _reading_findings(sub, hyp, explained)
    findings += reading_findings
    lq = sub.sampler_logprobs.double()
    coalitions = coal_lp - base[:, None]
    residual = lq - coal_lp[:, full] - sem
    delta = lq - base
    games = torch.cat([coalitions, coalitions + residual[:, None]], 1)  # [n, 16]: bit 3 = residual
    per_token = torch.cat([sem[:, None], games @ _SHAPLEY], 1)
    report = AttributionReport([], findings, token_index, coalitions, residual, sem, per_token, layout, causes,
                               {}, step)
    stale = [None if v < 0 else current_version - v for v in tok_version]
    buckets = [staleness_bucket(s) for s in stale]
    slices: list[tuple[str, str, str | None, str | None, str | None, Tensor]] = [
        ("all", "all", None, None, None, torch.arange(n))]
    gidx = sub.group_index
    for gi, name in enumerate(sub.group_names):
        if bool((gidx == gi).any()):
            slices.append(("group", name, name, fmt_of[name], None, (gidx == gi).nonzero().flatten()))
    for f in sorted(set(fmt_of[sub.group_names[g]] for g in torch.unique(gidx).tolist())):
        sel = torch.tensor([gfmt[g] == f for g in tok_group])
        slices.append(("format", f, None, f, None, sel.nonzero().flatten()))
    bucket_t = {b: torch.tensor([x == b for x in buckets]) for b in sorted(set(buckets), key=_bucket_order)}
    for b, sel in bucket_t.items():
        slices.append(("staleness", b, None, None, b, sel.nonzero().flatten()))
    for gi, name in enumerate(sub.group_names):
        for b, sel in bucket_t.items():
            here = (sel & (gidx == gi)).nonzero().flatten()
            if here.numel():
                slices.append(("group_staleness", f"{name} @ staleness {b}", name, fmt_of[name], b, here))
    sem_mistake = {}
    for f in reading_findings:
        if not f.ok:
            sem_mistake[f.mistake] = True
    for kind, label, group, fmt, bucket, idx in slices:
        report.slices.append(_slice(kind, label, group, fmt, bucket, idx, games, sem, per_token, delta,
                                    sorted(sem_mistake) if bool((sem[idx] != 0).any()) else [],
                                    kv_of.get(group or "", None), layout, replay is not None))
    report.cost = {"tokens": n, "rescores": sc.rescores, "token_evaluations": sc.evaluations,
                   "forward_passes": sc.passes, "seconds": seconds,
                   "seconds_per_10k_tokens": seconds * 1e4 / max(n, 1),
                   "token_evaluations_per_token": sc.evaluations / max(n, 1),
                   "rescores_per_10k_tokens": sc.evaluations * 1e4 / max(n, 1)}
    return report


def _bucket_order(b: str) -> tuple[int, int]:
    if b == "unknown":
        return (2, 0)
    if b == "ahead":
        return (-1, 0)
    return (0, int(b.split("-")[0]))


def _slice(kind, label, group, fmt, bucket, idx, games, sem, per_token, delta, mistakes, kv, layout, routed
           ) -> SliceAttribution:
    ok = torch.isfinite(games[idx]).all(1) & torch.isfinite(sem[idx])
    non_finite = int((~ok).sum())  # a token some re-score gives log p = -inf (outside a support): counted apart
    idx = idx[ok]
    g = games[idx].T  # [16, n]
    vals = _metrics(g)  # [16, 3] metric of each coalition (semantics off)
    phi = (vals.T @ _SHAPLEY)  # [3, 4]
    total = _metrics(delta[idx][None])[0]
    with_sem = total - vals[-1]  # the semantic part: the metric drops by this once the record is read right
    parts: dict[str, dict[str, float]] = {}
    for j, p in enumerate(PARTS):
        d: dict[str, float] = {}
        for m, name in enumerate(METRICS):
            v = float(with_sem[m]) if p == "semantics" else float(phi[m, j - 1])
            d[name] = v
            d["share_" + name] = v / float(total[m]) if float(total[m]) > 0 else float("nan")
        d["mean"] = float(per_token[idx, j].mean())
        parts[p] = d
    tot = {name: float(total[m]) for m, name in enumerate(METRICS)}
    tot["non_finite"] = non_finite
    name = {"all": "all tokens", "group": label, "format": f"the {label} groups", "staleness": f"staleness {label}",
            "group_staleness": label}[kind]
    rec = _recommend(name, tot, parts, mistakes, fmt, bucket, kv, layout, routed)
    return SliceAttribution(kind, label, group, fmt, bucket, int(idx.numel()) + non_finite, tot, parts, mistakes,
                            rec)


#: the next format up, for the format cause's recommendation
HIGHER_FORMAT = {"nvfp4": "FP8 blockwise or BF16", "mxfp4": "FP8 blockwise or BF16", "fp8": "BF16",
                 "bf16": "FP32", "fp16": "FP32"}


def _recommend(name, total, parts, mistakes, fmt, bucket, kv, layout, routed) -> str:
    """One sentence from the part with the largest share of mean |log r|, with the size it acts on."""
    size = (f"mean |log r| {total['mean_abs_log_r']:.3g}, {int(total['outside_band'])} tokens outside "
            f"[{MIS_BAND[0]}, {MIS_BAND[1]:g}]")
    if total["mean_abs_log_r"] < NEGLIGIBLE:
        return f"no measurable mismatch in {name} (mean |log r| = {total['mean_abs_log_r']:.2g})"
    share = {p: parts[p]["share_mean_abs_log_r"] for p in PARTS}
    top = max(share, key=lambda p: share[p])
    pct = f"{share[top]:.0%}"
    if top == "semantics":
        return (f"the record is mis-read ({', '.join(mistakes) or 'semantics'}): {pct} of {name} ({size}); "
                "fix the record first, every weight built on it corrects the wrong distribution")
    if top == "staleness":
        return (f"staleness explains {pct} of {name} ({size}" + (f", staleness {bucket}" if bucket else "")
                + "): sync weights more often or cap the staleness, or reject the stalest sequences (KLRejection)")
    if top == "format":
        if fmt is None:
            return (f"the weight formats explain {pct} of {name} ({size}): serve higher-precision formats where "
                    "the per-group rows show the largest format part, or mask extreme tokens (weights='mis')")
        return (f"the weight format {fmt} explains {pct} of {name} ({size}): serve it "
                f"{HIGHER_FORMAT.get(fmt, 'a higher-precision format')} weights, or mask its extreme tokens "
                "(weights='mis')")
    if top == "routing":
        return (f"routing explains {pct} of {name} ({size}): enable routing replay (R3), or reject tokens with more "
                "than k flipped layers (k from the group's route agreement)")
    tail = "" if routed else "; routing was not measured (no replay) and is part of it"
    return (f"{pct} of {name} ({size}) is left after the named causes (kernels, batch layout: "
            f"{layout['mean_abs']:.2g} mean |delta log p|, KV cache{' ' + kv if kv else ''}): compare the engine's "
            f"kernels and KV-cache precision with the trainer's{tail}")


__all__ = ["AttributionReport", "CAUSES", "MIS_BAND", "PARTS", "PLAYERS", "Rescorer", "ScoreBatch",
           "SliceAttribution", "attribute", "check_plan", "own_routing", "shapley_matrix",
           "staleness_bucket"]
