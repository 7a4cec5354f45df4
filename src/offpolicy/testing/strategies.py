"""Hypothesis strategies for off-policy policy-gradient losses: the inputs a sampler and a trainer produce.

Everything is generated in float64 on the CPU, small (a vocabulary of a few to a dozen tokens, a handful of
positions), and from hypothesis-native draws so that a failing example shrinks to a readable one.

Building blocks (public):

* :func:`trainer_logits`, :func:`mismatched_logits`: trainer logits ``[N, V]`` in several *profiles* (flat,
  generic, peaked, near-degenerate, heavy-tailed) and a sampler's logits with a controllable mismatch (noise of
  a drawn scale plus, optionally, one outlier token per row that the sampler over- or under-weights).
* :func:`temperatures`, :func:`advantages`, :func:`loss_masks`, :func:`packed_sequences`, :func:`filter_params`.
* :func:`sglang_support`: the realised top-p / top-k support, with SGLang's rule; :func:`support_record` and
  :func:`head_record` turn a sampler distribution into a :class:`~offpolicy.Candidates` record.

Composite strategies (what the checkers in :mod:`offpolicy.testing.properties` draw from):

* :func:`problems`: a batch (:class:`Problem`) for a given record kind, tokens drawn from the sampler's support;
  :func:`with_sequences` packs a batch into sequences; :func:`with_proximal` adds proximal log-probabilities;
  :func:`with_versions` adds policy versions (staleness) and :func:`with_route_flips` MoE route-flip counts.
* :func:`positions`: one position with a *complete* sampler model (:class:`Position`): a support record, a head
  record covering the vocabulary, or a partial head whose true tail is exactly ``rho * p``
  (docs/spec.md#inv-head-exact). A position expands into one row per possible token, for exact expectations over
  ``y ~ q``.
* :func:`hostile_problems`: the numerics of docs/spec.md#inv-hostile (``-inf`` logits, logits of +-1e4, underflowing and
  ``-inf`` candidate log-probabilities, empty candidate rows, extreme ratios and temperatures, ``N = 0``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal, Sequence

import torch
from hypothesis import assume
from hypothesis import strategies as st
from torch import Tensor

from offpolicy.records.candidates import Candidates

Record = Literal["head", "support"] | None
RECORDS = ("head", "support", None)
PROFILES = ("flat", "generic", "peaked", "near_degenerate", "heavy_tailed")

_NEG_INF = -math.inf
#: Positions whose exact sampler tail is modelled need both tail masses well above the spec's eps = 1e-6 floor,
#: so that ``1 - P_H`` and ``1 - Q_H`` (computed by subtraction) carry a relative error far below the checks'
#: tolerances: at 0.05 the float32 error of ``1 - P_H`` is about 2**-24 / 0.05 ~ 1e-6.
MIN_TAIL_MASS = 0.05


# ----------------------------------------------------------------------------------------------------------------
# Scalars and vectors
# ----------------------------------------------------------------------------------------------------------------


def temperatures(min_value: float = 0.05, max_value: float = 10.0) -> st.SearchStrategy[float]:
    """Sampling temperatures in ``[min_value, max_value]``: the common settings, the range's ends, or any value
    drawn log-uniformly (so that both 0.05 and 10 are reached)."""
    common = [t for t in (1.0, 0.7, 0.6, 1.3) if min_value <= t <= max_value]
    ends = st.sampled_from([min_value, max_value])
    lo, hi = math.log(min_value), math.log(max_value)
    anywhere = st.floats(lo, hi, allow_nan=False, allow_infinity=False).map(
        lambda u: min(max(math.exp(u), min_value), max_value)
    )
    common_st = st.sampled_from(common or [min_value])
    return st.one_of(common_st, common_st, ends, anywhere)


def advantages(n: int, constant: float | None = None, scale: float = 3.0) -> st.SearchStrategy[Tensor]:
    """``[n]`` float64 advantages in ``[-scale, scale]``, zeros included (tokens with ``A = 0`` are skipped by
    the spec's loss). With ``constant`` every entry equals it (the zero-drift setting of
    docs/spec.md#inv-zero-drift)."""
    if constant is not None:
        return st.just(torch.full((n,), float(constant), dtype=torch.float64))
    one = st.one_of(st.sampled_from([1.0, -1.0, 0.5, 0.0]), st.floats(-scale, scale, allow_nan=False))
    return st.lists(one, min_size=n, max_size=n).map(lambda a: torch.tensor(a, dtype=torch.float64).reshape(n))


def loss_masks(n: int, allow_empty: bool = True) -> st.SearchStrategy[Tensor]:
    """``[n]`` bool loss masks (True = trained); all-False masks only with ``allow_empty``."""
    masks = st.lists(st.booleans(), min_size=n, max_size=n).map(lambda m: torch.tensor(m, dtype=torch.bool).reshape(n))
    return masks if allow_empty else masks.filter(lambda m: n == 0 or bool(m.any()))


@st.composite
def packed_sequences(draw: st.DrawFn, n: int, max_sequences: int | None = None) -> Tensor:
    """``[n]`` int64 sequence ids of ``n`` tokens packed back to back: non-decreasing, starting at 0, one id per
    contiguous run (the layout of a packed / "remove-padding" batch)."""
    if n == 0:
        return torch.zeros(0, dtype=torch.int64)
    cap = n if max_sequences is None else min(n, max_sequences)
    count = draw(st.integers(1, cap))
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), min_size=count - 1, max_size=count - 1))) if count > 1 else []
    ids = torch.zeros(n, dtype=torch.int64)
    for c in cuts:
        ids[c:] += 1
    return ids


def filter_params(vocab: int) -> st.SearchStrategy[tuple[float, int]]:
    """``(top_p, top_k)`` sampling filters; ``top_k = -1`` is off. Includes the unfiltered ``(1.0, -1)``."""
    # Weighted towards the settings RL runs use (top-p 0.9-1, top-k off), which keep supports of several tokens.
    top_p = st.one_of(st.sampled_from([1.0, 0.99, 0.95, 0.9]), st.sampled_from([0.7, 0.5, 0.2]),
                      st.floats(0.05, 1.0, allow_nan=False))
    top_k = st.one_of(st.just(-1), st.just(-1), st.integers(1, vocab))
    return st.tuples(top_p, top_k)


# ----------------------------------------------------------------------------------------------------------------
# Logits
# ----------------------------------------------------------------------------------------------------------------


#: Mismatch scales: on-policy, small (kernel / precision noise), large (stale or quantised samplers), or any.
_MISMATCH = st.one_of(st.sampled_from([0.0, 0.05, 0.3, 1.0, 2.5, 5.0]), st.floats(0.0, 6.0))


def _shape_row(u: Sequence[float], profile: str, peak: int) -> list[float]:
    """Map ``u in [-1, 1]^V`` to logits of the given profile."""
    if profile == "flat":
        return [0.5 * x for x in u]
    if profile == "generic":
        return [4.0 * x for x in u]
    if profile == "peaked":
        return [4.0 * x + (8.0 if i == peak else 0.0) for i, x in enumerate(u)]
    if profile == "near_degenerate":
        # One token holds all but ~V e^-30 of the mass: P_H and Q_H sit at the eps floor of the tail model.
        return [x + (30.0 if i == peak else 0.0) for i, x in enumerate(u)]
    if profile == "heavy_tailed":
        # A Cauchy-like spread: tan(1.45 x) reaches +-8, times 3: most logits near 0, a few far out.
        return [3.0 * math.tan(1.45 * x) for x in u]
    raise ValueError(f"unknown logit profile {profile!r}; expected one of {PROFILES}")


@st.composite
def trainer_logits(draw: st.DrawFn, n: int, vocab: int, profile: str | None = None) -> Tensor:
    """``[n, vocab]`` float64 trainer logits of one profile (drawn from :data:`PROFILES` when None)."""
    prof = draw(st.sampled_from(PROFILES)) if profile is None else profile
    rows = []
    for _ in range(n):
        u = draw(st.lists(st.floats(-1.0, 1.0, allow_nan=False), min_size=vocab, max_size=vocab))
        rows.append(_shape_row(u, prof, draw(st.integers(0, vocab - 1))))
    return torch.tensor(rows, dtype=torch.float64).reshape(n, vocab)


@st.composite
def mismatched_logits(
    draw: st.DrawFn, n: int, vocab: int, profile: str | None = None, mismatch: float | None = None
) -> tuple[Tensor, Tensor]:
    """Trainer logits and sampler logits ``[n, vocab]`` (float64) with a controllable mismatch.

    The sampler's logits are ``z + mismatch * e`` with ``e in [-1, 1]^V`` per row, plus, when drawn, one outlier
    token per row shifted by +-6 (a rare token the sampler's numerics blow up or suppress: the ratios MIS masks).
    ``mismatch`` is drawn (0 = on-policy, up to 4) when None.
    """
    z = draw(trainer_logits(n, vocab, profile))
    scale = draw(_MISMATCH) if mismatch is None else mismatch
    outliers = draw(st.booleans())
    rows = []
    for t in range(n):
        e = draw(st.lists(st.floats(-1.0, 1.0, allow_nan=False), min_size=vocab, max_size=vocab))
        row = [z[t, i].item() + scale * e[i] for i in range(vocab)]
        if outliers:
            i = draw(st.integers(0, vocab - 1))
            row[i] += draw(st.sampled_from([6.0, -6.0]))
        rows.append(row)
    return z, torch.tensor(rows, dtype=torch.float64).reshape(n, vocab)


# ----------------------------------------------------------------------------------------------------------------
# Sampler records
# ----------------------------------------------------------------------------------------------------------------


def sglang_support(logprobs: Tensor, top_p: float = 1.0, top_k: int = -1) -> Tensor:
    """``[N, V]`` bool: the tokens SGLang's top-p / top-k filter keeps (the realised support).

    ``logprobs`` are the sampler's full-vocabulary log-probabilities *after temperature*; like SGLang, the rule
    runs on their float32 probabilities. Sorted in descending order (ties: the lower id first), the token at rank
    ``i`` is kept iff ``i < top_k`` and the mass before it, ``sum_{j < i} p_j``, is ``<= top_p`` (SGLang's
    ``top_k_top_p_min_p_sampling_from_probs_torch`` zeroes ``rank >= top_k`` and ``cumsum - p > top_p``), and its
    float32 probability is nonzero (multinomial sampling never draws a zero). Unfiltered (``top_p >= 1``,
    ``top_k = -1``: off) keeps every nonzero token. The most likely token is always kept.
    """
    if not (top_k == -1 or (int(top_k) == top_k and top_k >= 1)):
        raise ValueError(f"top_k must be -1 (off) or an integer >= 1, got {top_k!r}")
    if not 0.0 <= top_p <= 1.0:
        raise ValueError(f"top_p must be in [0, 1], got {top_p!r}")
    lp = logprobs.float()
    n, v = lp.shape
    if top_k == -1 and top_p >= 1.0:
        keep = lp.exp() > 0
        keep[torch.arange(n, device=lp.device), lp.argmax(dim=1)] = True
        return keep
    srt, order = torch.sort(lp, dim=1, descending=True, stable=True)
    probs = srt.exp()
    keep = (torch.cumsum(probs, dim=1) - probs) <= top_p
    if top_k != -1:
        keep &= torch.arange(v, device=lp.device).expand(n, v) < top_k
    keep &= probs > 0
    keep[:, :1] = True
    return torch.zeros_like(keep).scatter(1, order, keep)


def _pad_rows(ids_rows: list[list[int]], lp_rows: list[list[float]], width: int | None = None) -> tuple[Tensor, Tensor]:
    k = max((len(r) for r in ids_rows), default=0) if width is None else width
    ids = torch.full((len(ids_rows), k), -1, dtype=torch.int64)
    lp = torch.full((len(ids_rows), k), _NEG_INF, dtype=torch.float64)
    for t, (ir, lr) in enumerate(zip(ids_rows, lp_rows)):
        ids[t, : len(ir)] = torch.tensor(ir, dtype=torch.int64)
        lp[t, : len(lr)] = torch.tensor(lr, dtype=torch.float64)
    return ids, lp


def support_record(sampler_logits: Tensor, temperature: float, top_p: float, top_k: int) -> tuple[Candidates, Tensor]:
    """A ``kind="support"`` record of the realised supports, and the renormalised sampler distribution.

    Returns ``(candidates, logq_s)``: ids of each row's support in descending probability order (padded with
    ``-1``), their log-probabilities ``log q_S`` renormalised over the support, and ``logq_s [N, V]`` (float64,
    ``-inf`` outside the support).
    """
    x = sampler_logits.double() / temperature
    keep = sglang_support(torch.log_softmax(x, dim=1), top_p, top_k)
    logq_s = torch.log_softmax(x.masked_fill(~keep, _NEG_INF), dim=1)
    ids_rows, lp_rows = [], []
    for t in range(x.shape[0]):
        order = torch.sort(logq_s[t], descending=True, stable=True).indices
        kept = [int(i) for i in order if keep[t, i]]
        ids_rows.append(kept)
        lp_rows.append([logq_s[t, i].item() for i in kept])
    ids, lp = _pad_rows(ids_rows, lp_rows)
    return Candidates(ids, lp, "support"), logq_s


def head_record(sampler_logq: Tensor, k: int, counts: Sequence[int] | None = None) -> Candidates:
    """A ``kind="head"`` record: each row's top-``k`` tokens of the full sampler distribution ``sampler_logq``
    ``[N, V]`` (ties: the lower id first), with their log-probabilities; ``counts[t] <= k`` keeps fewer in row
    ``t`` (the rest is ``-1`` / ``-inf`` padding, e.g. an empty row with 0)."""
    order = torch.sort(sampler_logq, dim=1, descending=True, stable=True).indices[:, :k]
    ids_rows, lp_rows = [], []
    for t in range(sampler_logq.shape[0]):
        c = k if counts is None else counts[t]
        row = [int(i) for i in order[t, :c]]
        ids_rows.append(row)
        lp_rows.append([sampler_logq[t, i].item() for i in row])
    ids, lp = _pad_rows(ids_rows, lp_rows, width=k)
    return Candidates(ids, lp, "head")


# ----------------------------------------------------------------------------------------------------------------
# Problems: whole batches
# ----------------------------------------------------------------------------------------------------------------


def _fmt(x) -> str:
    """Compact, readable rendering of tensors and numbers (6 significant digits)."""
    if isinstance(x, Tensor):
        x = x.tolist()
    if isinstance(x, list):
        return "[" + ", ".join(_fmt(e) for e in x) + "]"
    if isinstance(x, float):
        return f"{x:.6g}"
    return repr(x)


@dataclass(frozen=True)
class Problem:
    """One batch as a loss function receives it, with the sampler distribution that produced it.

    Attributes:
        logits: ``[N, V]`` float64 trainer logits.
        tokens: ``[N]`` int64 sampled ids.
        sampler_logprobs: ``[N]`` float64 ``lq``: the sampler's log-probability of each token (renormalised over
            the support for support records).
        advantages: ``[N]`` float64.
        temperature: the sampling temperature (also what the trainer divides its logits by).
        candidates: the record, or None.
        sampler_logq: ``[N, V]`` float64 log of the sampler distribution the tokens were drawn from (``-inf``
            outside a support).
        notes: how the example was built (profile, mismatch, filter, hostile features), for failure reports.
        seq_ids: ``[N]`` int64 packed sequence ids (see :func:`with_sequences`), or None: every token stands
            alone.
        proximal_logprobs: ``[N]`` float64 ``log pi_prox(y_t)`` of the proximal policy (decoupled PPO, CISPO; see
            :func:`with_proximal`), or None.
        versions: ``[N]`` int64 policy version that sampled each token, with ``current_version`` the trainer's
            (an int; see :func:`with_versions`), or None.
        route_flips: ``[N]`` int64 MoE layers whose routing flipped at each token (see :func:`with_route_flips`),
            or None.
    """

    logits: Tensor
    tokens: Tensor
    sampler_logprobs: Tensor
    advantages: Tensor
    temperature: float
    candidates: Candidates | None
    sampler_logq: Tensor
    notes: dict = field(default_factory=dict)
    seq_ids: Tensor | None = None
    proximal_logprobs: Tensor | None = None
    versions: Tensor | None = None
    current_version: int | None = None
    route_flips: Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[0]

    @property
    def vocab(self) -> int:
        return self.logits.shape[1]

    def describe(self) -> str:
        """A multi-line, human-readable rendering (what failure messages print)."""
        lines = [f"N={self.num_tokens} V={self.vocab} temperature={_fmt(float(self.temperature))}"
                 + "".join(f" {k}={_fmt(v)}" for k, v in self.notes.items())]
        lines.append(f"logits           = {_fmt(self.logits)}")
        lines.append(f"tokens           = {_fmt(self.tokens)}")
        lines.append(f"sampler_logprobs = {_fmt(self.sampler_logprobs)}")
        lines.append(f"advantages       = {_fmt(self.advantages)}")
        if self.seq_ids is not None:
            lines.append(f"seq_ids          = {_fmt(self.seq_ids)}")
        if self.proximal_logprobs is not None:
            lines.append(f"proximal_logprobs = {_fmt(self.proximal_logprobs)}")
        if self.versions is not None:
            lines.append(f"versions         = {_fmt(self.versions)} (current_version={self.current_version})")
        if self.route_flips is not None:
            lines.append(f"route_flips      = {_fmt(self.route_flips)}")
        if self.candidates is None:
            lines.append("candidates       = None")
        else:
            lines.append(f"candidates.kind  = {self.candidates.kind!r}")
            lines.append(f"candidates.ids   = {_fmt(self.candidates.ids)}")
            lines.append(f"candidates.logprobs = {_fmt(self.candidates.logprobs)}")
        return "\n".join(lines)


def _tokens_from(draw: st.DrawFn, logq: Tensor) -> list[int]:
    """One token per row among those the sampler can emit (finite log-probability)."""
    out = []
    for t in range(logq.shape[0]):
        allowed = [i for i in range(logq.shape[1]) if math.isfinite(logq[t, i].item())]
        out.append(draw(st.sampled_from(allowed)))
    return out


def _record_for(draw: st.DrawFn, record: Record, s: Tensor, tau: float) -> tuple[Candidates | None, Tensor, dict]:
    """The record of the given kind for sampler logits ``s`` and the distribution tokens are drawn from."""
    n, v = s.shape
    logq = torch.log_softmax(s / tau, dim=1)
    if record == "support":
        top_p, top_k = draw(filter_params(v))
        cands, logq_s = support_record(s, tau, top_p, top_k)
        return cands, logq_s, {"top_p": top_p, "top_k": top_k}
    if record == "head":
        k = draw(st.integers(1, v))
        counts = draw(st.lists(st.integers(0, k), min_size=n, max_size=n)) if draw(st.booleans()) else None
        return head_record(logq, k, counts), logq, {"K": k}
    return None, logq, {}


@st.composite
def _problem_row(draw: st.DrawFn, v: int, profile: str, tau: float, record: Record, top_p: float, top_k: int, k: int,
                 advantage: float | None) -> dict:
    """One position of :func:`problems`, drawn on its own so that hypothesis can delete whole rows. Each row
    draws its own mismatch (scale and outlier), so that one batch mixes near-on-policy and far-off rows."""
    scale = draw(_MISMATCH)
    outliers = draw(st.booleans())
    z = torch.tensor(_shape_row(draw(st.lists(st.floats(-1.0, 1.0, allow_nan=False), min_size=v, max_size=v)),
                                profile, draw(st.integers(0, v - 1))), dtype=torch.float64)
    e = torch.tensor(draw(st.lists(st.floats(-1.0, 1.0, allow_nan=False), min_size=v, max_size=v)),
                     dtype=torch.float64)
    s = z + scale * e
    if outliers:
        s[draw(st.integers(0, v - 1))] += draw(st.sampled_from([6.0, -6.0]))
    if record == "support":
        cands, logq = support_record(s[None], tau, top_p, top_k)
    else:
        logq = torch.log_softmax(s / tau, dim=0)[None]
        count = draw(st.one_of(st.just(k), st.integers(0, k))) if record == "head" else 0
        cands = head_record(logq, k, [count]) if record == "head" else None
    token = _tokens_from(draw, logq)[0]
    adv = draw(advantages(1, constant=advantage))[0].item()
    return {"z": z, "logq": logq[0], "cands": cands, "token": token, "adv": adv, "mismatch": scale}


@st.composite
def problems(
    draw: st.DrawFn,
    record: Record = None,
    num_tokens: tuple[int, int] = (1, 5),
    vocab: tuple[int, int] = (2, 10),
    temperature: st.SearchStrategy[float] | None = None,
    advantage: float | None = None,
) -> Problem:
    """A batch with a sampler record of kind ``record`` (``"head"``, ``"support"`` or None).

    Trainer logits are of one profile (:data:`PROFILES`), sampler logits ``s = z + mismatch * e`` as in
    :func:`mismatched_logits`; the sampler distribution is ``softmax(s / tau)``, filtered by
    :func:`sglang_support` and renormalised over the support for support records (one ``(top_p, top_k)`` per
    batch); each token is one the sampler can emit and ``lq`` is its log-probability. Head records keep the
    sampler's top-``K`` (``K`` drawn; rows may hold fewer, or none). ``advantage`` fixes every advantage.
    """
    v = draw(st.integers(*vocab))
    # Support records are most informative with several tokens kept: favour the spread-out profiles there.
    spread = st.sampled_from(["flat", "generic"])
    profile = draw(st.one_of(spread, st.sampled_from(PROFILES)) if record == "support" else st.sampled_from(PROFILES))
    tau = draw(temperature if temperature is not None else temperatures())
    top_p, top_k = draw(filter_params(v)) if record == "support" else (1.0, -1)
    k = draw(st.integers(1, v)) if record == "head" else 0
    row = _problem_row(v, profile, tau, record, top_p, top_k, k, advantage)
    rows = draw(st.lists(row, min_size=num_tokens[0], max_size=num_tokens[1]))
    n = len(rows)
    z = torch.stack([r["z"] for r in rows]) if n else torch.zeros(0, v, dtype=torch.float64)
    logq = torch.stack([r["logq"] for r in rows]) if n else torch.zeros(0, v, dtype=torch.float64)
    tok = torch.tensor([r["token"] for r in rows], dtype=torch.int64).reshape(n)
    lq = logq.gather(1, tok[:, None]).reshape(n)
    adv = torch.tensor([r["adv"] for r in rows], dtype=torch.float64).reshape(n)
    cands = None
    if record is not None:
        width = k if record == "head" else max((r["cands"].width for r in rows), default=0)
        ids = torch.full((n, width), -1, dtype=torch.int64)
        lp = torch.full((n, width), _NEG_INF, dtype=torch.float64)
        for t, r in enumerate(rows):
            ids[t, : r["cands"].width] = r["cands"].ids[0]
            lp[t, : r["cands"].width] = r["cands"].logprobs[0]
        cands = Candidates(ids, lp, record)
    notes = {"profile": profile, "mismatch": [round(r["mismatch"], 3) for r in rows]}
    notes.update({"top_p": top_p, "top_k": top_k} if record == "support" else {"K": k} if record == "head" else {})
    return Problem(z, tok, lq, adv, tau, cands, logq, notes)


@st.composite
def with_sequences(draw: st.DrawFn, batches: st.SearchStrategy[Problem]) -> Problem:
    """A problem from ``batches`` with its tokens packed into random contiguous sequences (``seq_ids``; see
    :func:`packed_sequences`), for sequence-level weights and sequence-wise aggregations."""
    prob = draw(batches)
    return replace(prob, seq_ids=draw(packed_sequences(prob.num_tokens)))


#: Log-distances of the proximal policy from the trainer, ``log pi_prox(y) - log p(y)``: on-policy, around PPO's
#: usual clip band (0.2 - 0.28), far beyond it (``u = p / pi_prox = e^1.5 = 4.5``: past a dual clip of 3 and TRL's
#: delta; twice as often as ``e^-1.5``), and anywhere in ``[-1.6, 1.6]`` (``u`` in ``[0.2, 5]``).
_PROXIMAL_SHIFT = st.one_of(st.sampled_from([0.0, 0.1, -0.1, 0.3, -0.3]), st.sampled_from([-1.5, -1.5, 1.5]),
                            st.floats(-1.6, 1.6, allow_nan=False))


@st.composite
def with_proximal(draw: st.DrawFn, batches: st.SearchStrategy[Problem]) -> Problem:
    """A problem from ``batches`` with proximal log-probabilities (decoupled PPO, CISPO): ``log pi_prox(y_t) =
    min(log p(y_t) + d_t, 0)`` with ``d_t`` drawn per token (:data:`_PROXIMAL_SHIFT`) and ``p`` the trainer's
    distribution (over the support for support records), so that ``u = p / pi_prox`` falls on both sides of
    PPO's clip band; where the trainer gives the token probability 0 the sampler's ``lq`` stands in (the
    proximal policy is a real policy that emitted nothing impossible)."""
    prob = draw(batches)
    n = prob.num_tokens
    x = prob.logits / prob.temperature
    if prob.candidates is not None and prob.candidates.kind == "support":
        ids = prob.candidates.ids
        slot = torch.where(ids >= 0, ids, torch.full_like(ids, prob.vocab))
        inside = torch.zeros(n, prob.vocab + 1, dtype=torch.bool).scatter(1, slot, True)[:, :-1]
        x = x.masked_fill(~inside, _NEG_INF)
    logp_y = torch.log_softmax(x, dim=1).gather(1, prob.tokens[:, None]).reshape(n) if n else x.new_zeros(0)
    shifts = torch.tensor(draw(st.lists(_PROXIMAL_SHIFT, min_size=n, max_size=n)), dtype=torch.float64).reshape(n)
    prox = torch.where(torch.isfinite(logp_y), (logp_y + shifts).clamp(max=0.0), prob.sampler_logprobs)
    return replace(prob, proximal_logprobs=prox)


#: How many updates behind the trainer a token's policy is (mostly fresh, a tail of stale ones).
_LAGS = st.sampled_from([0, 0, 0, 0, 0, 1, 1, 2, 3])
#: MoE layers whose top-k expert set flipped at a token (mostly none).
_FLIPS = st.sampled_from([0, 0, 0, 1, 2, 4])


@st.composite
def with_versions(draw: st.DrawFn, batches: st.SearchStrategy[Problem]) -> Problem:
    """A problem from ``batches`` with the policy version of each token (staleness rejection): ``current_version``
    drawn in ``[3, 10]`` and ``versions_t = current_version - lag_t``, the lags from :data:`_LAGS`."""
    prob = draw(batches)
    current = draw(st.integers(3, 10))
    lags = draw(st.lists(_LAGS, min_size=prob.num_tokens, max_size=prob.num_tokens))
    return replace(prob, versions=current - torch.tensor(lags, dtype=torch.int64).reshape(prob.num_tokens),
                   current_version=current)


@st.composite
def with_route_flips(draw: st.DrawFn, batches: st.SearchStrategy[Problem]) -> Problem:
    """A problem from ``batches`` with each token's count of MoE layers whose routing flipped (route-flip
    rejection), from :data:`_FLIPS`."""
    prob = draw(batches)
    flips = draw(st.lists(_FLIPS, min_size=prob.num_tokens, max_size=prob.num_tokens))
    return replace(prob, route_flips=torch.tensor(flips, dtype=torch.int64).reshape(prob.num_tokens))


# ----------------------------------------------------------------------------------------------------------------
# Positions: one row with a complete sampler model, expanded over every possible token
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Position:
    """One position with a complete model of the sampler (for exact expectations over ``y ~ q``).

    Attributes:
        logits: ``[V]`` float64 trainer logits.
        sampler_logq: ``[V]`` float64 log of the *true* sampler distribution (``-inf`` where ``q = 0``).
        cand_ids, cand_logprobs: ``[K]`` the record (``kind``), or None without a record.
        kind: ``"head"`` / ``"support"`` / None.
        temperature: the sampling temperature.
        notes: how it was built.
    """

    logits: Tensor
    sampler_logq: Tensor
    cand_ids: Tensor | None
    cand_logprobs: Tensor | None
    kind: Record
    temperature: float
    notes: dict = field(default_factory=dict)

    @property
    def outcomes(self) -> Tensor:
        """``[M]`` int64 the tokens the sampler can emit (``q > 0``)."""
        return torch.nonzero(torch.isfinite(self.sampler_logq) & (self.sampler_logq.exp() > 0)).reshape(-1)

    def expand(self, advantages: Tensor | float = 1.0) -> Problem:
        """One row per possible token ``y`` (:attr:`outcomes`), identical logits and record in every row.

        ``advantages``: a float (the same for all rows) or ``[M]`` per outcome.
        """
        ys = self.outcomes
        m = ys.shape[0]
        adv = torch.full((m,), float(advantages), dtype=torch.float64) if not isinstance(advantages, Tensor) \
            else advantages.double().reshape(m)
        cands = None
        if self.kind is not None:
            cands = Candidates(self.cand_ids.expand(m, -1).clone(), self.cand_logprobs.expand(m, -1).clone(),
                               self.kind)
        return Problem(self.logits.expand(m, -1).clone(), ys, self.sampler_logq[ys].clone(), adv,
                       self.temperature, cands, self.sampler_logq.expand(m, -1).clone(), dict(self.notes))

    def describe(self) -> str:
        lines = [f"V={self.logits.shape[0]} temperature={_fmt(float(self.temperature))} record={self.kind!r}"
                 + "".join(f" {k}={_fmt(v)}" for k, v in self.notes.items())]
        lines.append(f"trainer logits     = {_fmt(self.logits)}")
        lines.append(f"sampler log q      = {_fmt(self.sampler_logq)}")
        if self.kind is not None:
            lines.append(f"candidates.ids     = {_fmt(self.cand_ids)}")
            lines.append(f"candidates.logprobs= {_fmt(self.cand_logprobs)}")
        return "\n".join(lines)


def _ratios_inside(z: Tensor, logq: Tensor, tau: float, support: Tensor | None, lo: float, hi: float,
                   margin: float) -> bool:
    """Whether every possible token's ratio ``p(y) / q(y)`` lies in ``[lo e^margin, hi e^-margin]``."""
    x = z / tau
    if support is not None:
        x = x.masked_fill(~support, _NEG_INF)
    logp = torch.log_softmax(x, dim=0)
    can = torch.isfinite(logq)
    log_r = (logp - logq)[can]
    lo_ok = True if lo <= 0 else bool((log_r >= math.log(lo) + margin).all())
    return lo_ok and bool((log_r <= math.log(hi) - margin).all())


@st.composite
def positions(
    draw: st.DrawFn,
    record: Record = None,
    vocab: tuple[int, int] = (2, 8),
    complete: bool | None = None,
    ratio_bounds: tuple[float, float] | None = None,
    temperature: st.SearchStrategy[float] | None = None,
) -> Position:
    """A :class:`Position` whose record describes the sampler *exactly*.

    * ``record="support"``: the realised SGLang support and ``q_S`` over it (the tail is empty).
    * ``record="head"``: with ``complete=True`` the record covers the vocabulary (``K = V``); with
      ``complete=False`` it holds the sampler's top-``K`` (``K < V``) and the sampler's true tail is
      ``q(v) = rho p(v)`` outside it, ``rho = (1 - Q_H) / (1 - P_H)``, the model under which
      docs/spec.md#inv-head-exact says the head formula is exact. ``complete=None`` draws either.
    * ``record=None``: no record; the sampler is the full ``softmax(s / tau)``.

    ``ratio_bounds=(L, U)`` shrinks the mismatch until every possible token's ratio lies inside ``[L, U]`` (with
    a relative margin of 1e-3), so that any weight function with ``f(r) = r`` there is exactly plain IS.
    """
    v = draw(st.integers(*vocab))
    profile = draw(st.sampled_from(("flat", "generic", "peaked", "heavy_tailed")))
    z2, s2 = draw(mismatched_logits(1, v, profile))
    z, s = z2[0], s2[0]
    tau = draw(temperature if temperature is not None else temperatures())
    top_p, top_k = draw(filter_params(v)) if record == "support" else (1.0, -1)
    full = draw(st.booleans()) if (record == "head" and complete is None) else bool(complete)

    def model(sl: Tensor) -> tuple[Tensor, Tensor | None]:
        if record == "support":
            _, logq_s = support_record(sl[None], tau, top_p, top_k)
            return logq_s[0], torch.isfinite(logq_s[0])
        return torch.log_softmax(sl / tau, dim=0), None

    logq, support = model(s)
    if ratio_bounds is not None:
        lo, hi = ratio_bounds
        assume(lo <= 1.0 <= hi)
        for _ in range(60):
            if _ratios_inside(z, logq, tau, support, lo, hi, 1e-3):
                break
            s = z + 0.5 * (s - z)
            logq, support = model(s)
        else:
            s = z.clone()
            logq, support = model(s)
    notes = {"profile": profile}
    if record == "support":
        ids = torch.nonzero(support).reshape(-1)
        return Position(z, logq, ids, logq[ids].clone(), "support", tau, {**notes, "top_p": top_p, "top_k": top_k})
    if record is None:
        return Position(z, logq, None, None, None, tau, notes)
    if full:
        ids = torch.arange(v)
        return Position(z, logq, ids, logq.clone(), "head", tau, {**notes, "K": v})
    # Partial head with the exact tail q = rho p outside the top-K.
    assume(v >= 2)
    k = draw(st.integers(1, v - 1))
    order = torch.sort(logq, descending=True, stable=True).indices
    logp = torch.log_softmax(z / tau, dim=0)
    while k >= 1:
        head = order[:k]
        tail = order[k:]
        q_tail, p_tail = logq[tail].exp().sum().item(), logp[tail].exp().sum().item()
        if q_tail >= MIN_TAIL_MASS and p_tail >= MIN_TAIL_MASS:
            break
        k -= 1
    assume(k >= 1)
    true_logq = logq.clone()
    true_logq[tail] = math.log(q_tail) - math.log(p_tail) + logp[tail]
    return Position(z, true_logq, head.clone(), logq[head].clone(), "head", tau,
                    {**notes, "K": k, "rho": q_tail / p_tail})


# ----------------------------------------------------------------------------------------------------------------
# Hostile numerics (docs/spec.md#inv-hostile)
# ----------------------------------------------------------------------------------------------------------------


@st.composite
def hostile_problems(draw: st.DrawFn, record: Record = None, zero_weight_at_zero_ratio: bool = False) -> Problem:
    """Batches with the numerics of docs/spec.md#inv-hostile on which a correct loss is finite.

    Features (each drawn on or off per example): logits of +-1e4 (probabilities underflowing to exactly 0);
    ``-inf`` logits; a degenerate sampler (one token holds all the mass, the others' ``q`` underflows); ``-inf``
    and deeply underflowing (``-1e4``) candidate log-probabilities; empty head rows; sampled tokens with extreme
    ratios (``lq = -200`` for a likely token, or a trainer-improbable token the sampler liked); temperatures of
    0.05 and 10; ``N = 0``.

    A ``-inf`` logit is placed on a recorded candidate or on the sampled token only when
    ``zero_weight_at_zero_ratio`` (the weight function gives ``f(0) = 0``: MIS, TIS with lower bound 0,
    rejection with ``L > 0``); otherwise the spec's loss is itself infinite there (``-A w log 0``).
    """
    n = draw(st.integers(0, 4))
    v = draw(st.integers(2, 8))
    tau = draw(st.sampled_from([0.05, 0.1, 1.0, 4.0, 10.0]))
    big = draw(st.booleans())
    neg_inf = draw(st.booleans())
    degenerate = draw(st.booleans())
    inf_cands = draw(st.booleans())
    underflow_cands = draw(st.booleans())
    extreme = draw(st.booleans())
    z, s = draw(mismatched_logits(n, v, draw(st.sampled_from(PROFILES))))
    if big:
        signs = draw(st.lists(st.sampled_from([1e4, -1e4, 0.0]), min_size=n * v, max_size=n * v))
        z = z + torch.tensor(signs, dtype=torch.float64).reshape(n, v)
    if degenerate:
        for t in range(n):
            s[t, draw(st.integers(0, v - 1))] += 1e4
    cands, logq, notes = _record_for(draw, record, s, tau)
    if record == "head" and n:
        lp = cands.logprobs.clone()
        ids = cands.ids.clone()
        if inf_cands or underflow_cands:
            for t in range(n):
                for j in range(ids.shape[1]):
                    if ids[t, j] >= 0 and draw(st.booleans()):
                        lp[t, j] = _NEG_INF if inf_cands and (not underflow_cands or draw(st.booleans())) else -1e4
        if draw(st.booleans()):
            t = draw(st.integers(0, n - 1))
            ids[t] = -1
            lp[t] = _NEG_INF
        cands = Candidates(ids, lp, "head")
    tokens = _tokens_from(draw, logq)
    tok = torch.tensor(tokens, dtype=torch.int64).reshape(n)
    lq = logq.gather(1, tok[:, None]).reshape(n).clone()
    if extreme and n:
        t = draw(st.integers(0, n - 1))
        recorded = cands is not None and bool((cands.ids[t] == tok[t]).any())
        if cands is None or (record == "head" and not recorded):
            # The sampler says it was (nearly) impossible: log r ~ +200, or +1e4 (exp overflows) before clamping.
            lq[t] = draw(st.sampled_from([-200.0, -1e4]))
        z[t, tok[t]] = z[t, tok[t]] - 1e4  # the trainer thinks it nearly impossible: log r ~ -1e4 / tau
    if neg_inf and n:
        recorded_ids = cands.ids if cands is not None else torch.full((n, 0), -1, dtype=torch.int64)
        for t in range(n):
            y = int(tok[t])
            # One finite logit stays (inside the support for support records) so that p exists.
            pool = [int(i) for i in recorded_ids[t] if i >= 0] if record == "support" else list(range(v))
            others = [i for i in pool if i != y]
            anchor = max(others, key=lambda i: z[t, i].item()) if others else y
            protected = {anchor}
            if not zero_weight_at_zero_ratio:
                protected |= {int(i) for i in recorded_ids[t] if i >= 0} | {y}
            elif y != anchor and draw(st.booleans()):
                z[t, y] = _NEG_INF  # the trainer finds the sampled token impossible: r = 0, w = f(0) = 0
            for i in range(v):
                if i not in protected and i != y and draw(st.booleans()):
                    z[t, i] = _NEG_INF
    adv = draw(advantages(n))
    feats = [name for name, on in (("big", big), ("neg_inf", neg_inf), ("degenerate", degenerate),
                                    ("inf_cands", inf_cands), ("underflow_cands", underflow_cands),
                                    ("extreme", extreme)) if on]
    return Problem(z, tok, lq, adv, tau, cands, logq, {"hostile": ",".join(feats) or "-", **notes})
