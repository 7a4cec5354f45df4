"""A reference sampler in plain torch: temperature, top-k and top-p exactly as SGLang filters, recording the
same contract as the SGLang / vLLM adapters (tokens, sampler log-probabilities, a :class:`Candidates` record).

It drives any causal ``nn.Module`` language model that maps ``input_ids [B, L]`` to logits ``[B, L, V]`` (a
tensor, or an object with ``.logits`` such as a Hugging Face ``CausalLMOutput``). There is no KV cache: every
step re-runs the model on the whole (right-padded) batch and reads the logits at each row's last position.
Right padding is harmless for a causal model because no position attends to later ones; this is the one
assumption on ``model``. It is meant for toy scale (tests, the CPU demo, checking a pipeline without a GPU).

    from offpolicy.fleet.sampler import sample
    r = sample(model, prompts, max_new_tokens=16, temperature=1.0, top_p=0.9, record="support")
    r = r.append(tool_output_ids)                  # multi-turn: tool tokens, not trained
    r = sample(model, r, max_new_tokens=16, top_p=0.9, record="support")   # the next turn
    batch = r.flatten()                            # tokens, sampler_logprobs, candidates, loss_mask ... [N]
    trainer_logits = batch.gather(trainer_model(r.sequences))            # [N, V]

Filtering (SGLang's ``top_k_top_p_min_p_sampling_from_probs_torch``, and the ``joint`` order of its FlashInfer
path): on the post-temperature distribution ``p = softmax(z / T)`` sorted in descending order, token at rank
``i`` is kept iff ``i < top_k`` and ``sum_{j < i} p_j <= top_p`` (the mass *before* it). The sampled token and
the record then use ``q_S = p / P(S)`` over the kept set ``S``. ``filter_semantics="vllm"`` reproduces vLLM's
order instead: top-k first (keeping every token tied with the k-th logit), then top-p on the top-k
renormalised distribution, keeping a token iff the mass before it is ``< top_p``.

Records: ``record="head"`` (unfiltered sampling only) stores the top-``k`` tokens of ``p`` with their
log-probabilities; ``record="support"`` stores the whole realised support with ``log q_S`` (each row sums to
one); ``record=None`` stores no candidates. Ties in the sort are broken by the lower token id.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from offpolicy.records.candidates import Candidates
from offpolicy.records.csr_candidates import CSRCandidates
from offpolicy.records.token_batch import TokenBatch

FILTER_SEMANTICS = ("sglang", "vllm")


def _check_sampling_params(temperature: float, top_p: float, top_k: int | None) -> int | None:
    if not isinstance(temperature, (int, float)) or not temperature > 0 or temperature != temperature:
        raise ValueError(
            f"temperature must be > 0, got {temperature!r}. Temperature 0 is greedy decoding: it has no sampling "
            "distribution, so importance ratios are undefined (and SGLang then returns raw log-probs)."
        )
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if top_k is None or top_k == -1:
        return None
    if int(top_k) != top_k or top_k < 1:
        raise ValueError(f"top_k must be None, -1 (off) or an integer >= 1, got {top_k!r}")
    return int(top_k)


def support_mask(
    logprobs: Tensor, top_k: int | None = None, top_p: float = 1.0, semantics: str = "sglang"
) -> Tensor:
    """The kept set of top-k / top-p filtering.

    Args:
        logprobs: ``[B, V]`` float log-probabilities *after temperature* (a full-vocabulary log-softmax).
        top_k: keep at most this many tokens (``None`` or ``-1``: off).
        top_p: nucleus threshold in ``(0, 1]``.
        semantics: ``"sglang"`` (joint: rank < k and mass-before <= top_p on the full distribution) or
            ``"vllm"`` (top-k with ties, then mass-before < top_p on the top-k renormalised distribution).

    Returns:
        ``[B, V]`` bool, True on kept tokens. At least one token (the most likely) is always kept; tokens of
        probability 0 never are (``"sglang"``: fp32 probability 0, underflow included; ``"vllm"``: ``-inf``).
    """
    top_k = _check_sampling_params(1.0, top_p, top_k)
    if semantics not in FILTER_SEMANTICS:
        raise ValueError(f"semantics must be one of {FILTER_SEMANTICS}, got {semantics!r}")
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, V], got shape {tuple(logprobs.shape)}")
    b, v = logprobs.shape
    if top_k is None and top_p >= 1.0:
        keep = logprobs.float().exp() > 0 if semantics == "sglang" else logprobs > float("-inf")
        keep[torch.arange(b, device=logprobs.device), logprobs.argmax(dim=1)] = True
        return keep
    sorted_lp, order = torch.sort(logprobs.float(), dim=1, descending=True, stable=True)
    keep_sorted = support_mask_sorted(sorted_lp, top_k, top_p, semantics)
    keep = torch.zeros(b, v, dtype=torch.bool, device=logprobs.device)
    return keep.scatter(1, order, keep_sorted)


def support_mask_sorted(sorted_lp: Tensor, top_k: int | None, top_p: float, semantics: str) -> Tensor:
    """:func:`support_mask` on rows already sorted in descending order (``[B, V]`` fp32): the kept mask in that
    order. The order of a row does not change with the temperature, so a caller scanning temperatures sorts once."""
    b, v = sorted_lp.shape
    rank = torch.arange(v, device=sorted_lp.device).expand(b, v)
    if semantics == "sglang":
        probs = sorted_lp.exp()
        mass_before = torch.cumsum(probs, dim=1) - probs
        keep_sorted = mass_before <= top_p
        if top_k is not None:
            keep_sorted &= rank < top_k
    else:
        keep_sorted = torch.ones(b, v, dtype=torch.bool, device=sorted_lp.device)
        if top_k is not None:
            kth = sorted_lp[:, min(top_k, v) - 1 : min(top_k, v)]
            keep_sorted &= sorted_lp >= kth
        if top_p < 1.0:
            masked = sorted_lp.masked_fill(~keep_sorted, float("-inf"))
            probs = torch.softmax(masked, dim=1)
            mass_before = torch.cumsum(probs, dim=1) - probs
            keep_sorted &= mass_before < top_p
    # zero-probability tokens never enter a support: SGLang's support is {w > 0} on fp32 probabilities (so
    # underflowed tokens drop out too), vLLM's the finite filtered logits
    keep_sorted &= sorted_lp.exp() > 0 if semantics == "sglang" else sorted_lp > float("-inf")
    keep_sorted[:, 0] = True
    return keep_sorted


@dataclass(frozen=True)
class Rollout:
    """Sampled sequences with per-position sampler records (all ``[B, L]``, right-padded).

    Attributes:
        sequences: int64 token ids; past ``lengths`` they hold ``pad_token_id``.
        lengths: ``[B]`` int64 valid length of each row.
        sampled: bool, True where the sampler emitted the token (prompt and tool tokens are False).
        loss_mask: bool, True on sampled tokens that are trained.
        sampler_logprobs: fp32 ``lq`` at sampled positions, 0 elsewhere.
        cand_ids: ``[B, L, K]`` int64 candidate ids (``-1`` padding) or ``None`` when no record was kept.
        cand_logprobs: ``[B, L, K]`` fp32 candidate log-probabilities (``-inf`` padding) or ``None``.
        kind: ``"head"``, ``"support"`` or ``None``.
        versions: int64 policy version per sampled position (``-1`` elsewhere).
        temperature: fp32 temperature per sampled position (0 elsewhere).
        finished: ``[B]`` bool, True where the last turn ended with ``eos_token_id``.
        pad_token_id: the id used for right padding.
    """

    sequences: Tensor
    lengths: Tensor
    sampled: Tensor
    loss_mask: Tensor
    sampler_logprobs: Tensor
    cand_ids: Tensor | None
    cand_logprobs: Tensor | None
    kind: str | None
    versions: Tensor
    temperature: Tensor
    finished: Tensor
    pad_token_id: int = 0

    @property
    def batch_size(self) -> int:
        return self.sequences.shape[0]

    def append(self, tokens: Sequence[Sequence[int]] | Tensor) -> "Rollout":
        """Append non-sampled, non-trained tokens to each row (tool outputs, a chat template's turn markers).

        ``tokens`` is one sequence of ids per row (possibly empty). Returns a new rollout.
        """
        rows = _as_rows(tokens, "tokens")
        if len(rows) != self.batch_size:
            raise ValueError(f"append: expected {self.batch_size} rows of tokens, got {len(rows)}")
        extra = max((len(r) for r in rows), default=0)
        out = self._grow(extra)
        seq = out.sequences.clone()
        lengths = out.lengths.clone()
        for b, row in enumerate(rows):
            n = len(row)
            if n:
                start = int(lengths[b])
                seq[b, start : start + n] = torch.tensor(row, dtype=torch.int64, device=seq.device)
                lengths[b] += n
        return replace(out, sequences=seq, lengths=lengths)

    def flatten(self, csr: bool = False) -> TokenBatch:
        """The sampled positions as flat ``[N]`` tensors (row-major order); with ``csr`` the record is a
        :class:`~offpolicy.CSRCandidates` (each position's own entries, no padding; docs/spec.md#record-memory)."""
        rows, cols = self.sampled.nonzero(as_tuple=True)
        cands = None
        if self.cand_ids is not None:
            ids, lps = self.cand_ids[rows, cols], self.cand_logprobs[rows, cols]
            width = int((ids >= 0).sum(dim=1).max()) if ids.shape[0] else 0
            cands = Candidates(ids[:, :width].contiguous(), lps[:, :width].contiguous(), self.kind)
            if csr:
                cands = CSRCandidates.from_padded(cands)
        return TokenBatch(
            tokens=self.sequences[rows, cols],
            sampler_logprobs=self.sampler_logprobs[rows, cols],
            candidates=cands,
            loss_mask=self.loss_mask[rows, cols],
            seq_ids=rows,
            versions=self.versions[rows, cols],
            rows=rows,
            cols=cols,
            temperature=self.temperature[rows, cols],
        )

    def _grow(self, extra_len: int, width: int | None = None) -> "Rollout":
        """A copy with ``extra_len`` more columns (and candidate width ``width``), padded."""
        b, length = self.sequences.shape
        new_len = max(length, int(self.lengths.max()) + extra_len if b else 0)

        def pad(t: Tensor, value: float) -> Tensor:
            return F.pad(t, (0, new_len - t.shape[1]), value=value) if new_len > t.shape[1] else t

        cand_ids, cand_lp = self.cand_ids, self.cand_logprobs
        if cand_ids is not None:
            w = max(cand_ids.shape[2], width or 0)
            cand_ids = F.pad(cand_ids, (0, w - cand_ids.shape[2], 0, new_len - cand_ids.shape[1]), value=-1)
            cand_lp = F.pad(
                cand_lp, (0, w - cand_lp.shape[2], 0, new_len - cand_lp.shape[1]), value=float("-inf")
            )
        return replace(
            self,
            sequences=pad(self.sequences, self.pad_token_id),
            sampled=pad(self.sampled, False),
            loss_mask=pad(self.loss_mask, False),
            sampler_logprobs=pad(self.sampler_logprobs, 0.0),
            cand_ids=cand_ids,
            cand_logprobs=cand_lp,
            versions=pad(self.versions, -1),
            temperature=pad(self.temperature, 0.0),
        )


def _as_rows(tokens: Sequence[Sequence[int]] | Tensor, name: str) -> list[list[int]]:
    if isinstance(tokens, Tensor):
        if tokens.dim() != 2 or tokens.is_floating_point():
            raise ValueError(f"{name}: a tensor must be [B, L] integer ids, got {tuple(tokens.shape)} {tokens.dtype}")
        return [[int(t) for t in row] for row in tokens]
    try:
        return [[int(t) for t in row] for row in tokens]
    except TypeError as exc:
        raise TypeError(f"{name}: expected a [B, L] tensor or a sequence of id sequences") from exc


def _new_rollout(prompts: Sequence[Sequence[int]] | Tensor, pad_token_id: int, device: torch.device) -> Rollout:
    rows = _as_rows(prompts, "prompts")
    if not rows or any(len(r) == 0 for r in rows):
        raise ValueError("prompts: need at least one row, and every prompt must hold at least one token")
    b, length = len(rows), max(len(r) for r in rows)
    seq = torch.full((b, length), pad_token_id, dtype=torch.int64, device=device)
    for i, r in enumerate(rows):
        seq[i, : len(r)] = torch.tensor(r, dtype=torch.int64, device=device)
    zeros_b = torch.zeros(b, length, dtype=torch.bool, device=device)
    return Rollout(
        sequences=seq,
        lengths=torch.tensor([len(r) for r in rows], dtype=torch.int64, device=device),
        sampled=zeros_b,
        loss_mask=zeros_b.clone(),
        sampler_logprobs=torch.zeros(b, length, device=device),
        cand_ids=None,
        cand_logprobs=None,
        kind=None,
        versions=torch.full((b, length), -1, dtype=torch.int64, device=device),
        temperature=torch.zeros(b, length, device=device),
        finished=torch.zeros(b, dtype=torch.bool, device=device),
        pad_token_id=pad_token_id,
    )


def _logits_of(output: object) -> Tensor:
    logits = output.logits if hasattr(output, "logits") else output
    if not isinstance(logits, Tensor) or logits.dim() != 3:
        raise TypeError(
            "model must return logits [B, L, V] (a tensor or an object with .logits); got "
            f"{type(logits).__name__} {tuple(getattr(logits, 'shape', ()))}"
        )
    return logits


@torch.no_grad()
def sample(
    model: nn.Module,
    prompts: Sequence[Sequence[int]] | Tensor | Rollout,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int | None = None,
    record: str | None = "head",
    k: int = 8,
    *,
    eos_token_id: int | None = None,
    pad_token_id: int = 0,
    trained: bool = True,
    version: int = 0,
    active: Tensor | None = None,
    max_support: int | None = None,
    filter_semantics: str = "sglang",
    numerics: str | Callable[[nn.Module], nn.Module] | None = None,
    logits_hook: Callable[[Tensor], Tensor] | None = None,
    generator: torch.Generator | None = None,
) -> Rollout:
    """Sample up to ``max_new_tokens`` per row and record the sampler's distribution.

    Args:
        model: a causal LM, ``input_ids [B, L] -> logits [B, L, V]`` (tensor or ``.logits``). Run in eval mode
            for the call (its mode is restored after).
        prompts: ``[B, P]`` ids, one id sequence per row (ragged allowed), or a :class:`Rollout` to continue
            (the next turn of a multi-turn episode).
        max_new_tokens: tokens to generate per row (fewer where ``eos_token_id`` appears).
        temperature: ``> 0``.
        top_p, top_k: nucleus and top-k filters (``top_k=None`` or ``-1``: off).
        record: ``"head"`` (top-``k`` of the unfiltered distribution), ``"support"`` (the realised support,
            renormalised) or ``None``.
        k: head width for ``record="head"``.
        eos_token_id: a row stops after emitting it (the EOS token is recorded and trained).
        pad_token_id: right-padding id.
        trained: whether this turn's tokens are trained (``loss_mask``).
        version: policy version stamped on each sampled token (for staleness metrics).
        active: ``[B]`` bool, rows that generate in this call (default all).
        max_support: raise if a support exceeds this size (as SGLang aborts past ``--sampling-mask-max-tokens``);
            never truncated.
        filter_semantics: ``"sglang"`` (default) or ``"vllm"``, see :func:`support_mask`.
        numerics: run the sampler on other numerics: a weight format name (``"nvfp4"``, ``"fp8"``, ...; the
            model is fake-quantised once per call, on a copy) or a callable ``model -> model``. For many calls,
            quantise once with :func:`offpolicy.fleet.quant.fake_quantize_module` and pass the copy as ``model``.
        logits_hook: applied to the ``[B, V]`` last-position logits before temperature (e.g. a bf16 round).
        generator: a ``torch.Generator`` for reproducible draws.

    Returns:
        A :class:`Rollout`.
    """
    top_k = _check_sampling_params(temperature, top_p, top_k)
    if record not in ("head", "support", None):
        raise ValueError(f"record must be 'head', 'support' or None, got {record!r}")
    if filter_semantics not in FILTER_SEMANTICS:
        raise ValueError(f"filter_semantics must be one of {FILTER_SEMANTICS}, got {filter_semantics!r}")
    filtered = top_k is not None or top_p < 1.0
    if record == "head" and filtered:
        raise ValueError(
            "record='head' needs unfiltered sampling (top_p=1, top_k off): a filtered sampler's distribution is "
            "renormalised over its support, so record='support' (mask replay) is the matching record"
        )
    if record == "head" and (int(k) != k or k < 1):
        raise ValueError(f"k must be an integer >= 1 for record='head', got {k!r}")
    if int(max_new_tokens) != max_new_tokens or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if isinstance(prompts, Rollout):
        roll = prompts
        if bool(roll.sampled.any()) and roll.kind != record:
            raise ValueError(
                f"cannot continue a rollout recorded as {roll.kind!r} with record={record!r}: every turn of a "
                "rollout must keep the same kind of record"
            )
        roll = replace(roll, finished=torch.zeros_like(roll.finished))
    else:
        roll = _new_rollout(prompts, pad_token_id, device)
    if record is not None and roll.cand_ids is None:
        b, length = roll.sequences.shape
        roll = replace(
            roll,
            cand_ids=torch.full((b, length, 0), -1, dtype=torch.int64, device=device),
            cand_logprobs=torch.full((b, length, 0), float("-inf"), device=device),
            kind=record,
        )
    if active is None:
        active = torch.ones(roll.batch_size, dtype=torch.bool, device=device)
    elif active.shape != (roll.batch_size,) or active.dtype != torch.bool:
        raise ValueError(f"active must be a [B] bool tensor with B={roll.batch_size}")

    runner = model
    if isinstance(numerics, str):
        from offpolicy.fleet.quant import fake_quantize_module

        runner = fake_quantize_module(model, numerics)
    elif numerics is not None:
        runner = numerics(model)

    width = k if record == "head" else 0
    roll = roll._grow(max_new_tokens, width)
    seq, lengths = roll.sequences.clone(), roll.lengths.clone()
    sampled, loss_mask = roll.sampled.clone(), roll.loss_mask.clone()
    slp, versions, temps = roll.sampler_logprobs.clone(), roll.versions.clone(), roll.temperature.clone()
    cand_ids = roll.cand_ids.clone() if roll.cand_ids is not None else None
    cand_lp = roll.cand_logprobs.clone() if roll.cand_logprobs is not None else None
    done = ~active.clone()
    finished = torch.zeros_like(done)

    was_training = runner.training
    runner.eval()
    try:
        for _ in range(int(max_new_tokens)):
            rows = (~done).nonzero(as_tuple=True)[0]
            if rows.numel() == 0:
                break
            cur = lengths[rows]
            logits = _logits_of(runner(seq[rows, : int(cur.max())]))
            z = logits[torch.arange(rows.numel(), device=device), cur - 1].float()
            if logits_hook is not None:
                z = logits_hook(z).float()
            lp = torch.log_softmax(z / temperature, dim=-1)
            keep = support_mask(lp, top_k, top_p, filter_semantics)
            lq = torch.where(keep, lp - torch.logsumexp(lp.masked_fill(~keep, float("-inf")), 1, True), -torch.inf)
            y = torch.multinomial(lq.exp(), 1, generator=generator).squeeze(1)
            pos = cur
            seq[rows, pos] = y
            sampled[rows, pos] = True
            loss_mask[rows, pos] = trained
            slp[rows, pos] = lq.gather(1, y[:, None]).squeeze(1)
            versions[rows, pos] = version
            temps[rows, pos] = float(temperature)
            if record is not None:
                ids, vals = _record(lp, lq, keep, record, k, max_support)
                if ids.shape[1] > cand_ids.shape[2]:
                    grow = ids.shape[1] - cand_ids.shape[2]
                    cand_ids = F.pad(cand_ids, (0, grow), value=-1)
                    cand_lp = F.pad(cand_lp, (0, grow), value=float("-inf"))
                cand_ids[rows, pos, : ids.shape[1]] = ids
                cand_lp[rows, pos, : ids.shape[1]] = vals
            lengths[rows] += 1
            if eos_token_id is not None:
                hit = y == eos_token_id
                finished[rows[hit]] = True
                done[rows[hit]] = True
    finally:
        runner.train(was_training)
    return replace(
        roll,
        sequences=seq,
        lengths=lengths,
        sampled=sampled,
        loss_mask=loss_mask,
        sampler_logprobs=slp,
        cand_ids=cand_ids,
        cand_logprobs=cand_lp,
        versions=versions,
        temperature=temps,
        finished=finished,
    )


def _record(
    lp: Tensor, lq: Tensor, keep: Tensor, record: str, k: int, max_support: int | None
) -> tuple[Tensor, Tensor]:
    """Candidate ids and log-probs for one step: ``[R, W]`` each, sorted by probability, padded."""
    if record == "head":
        vals, ids = torch.sort(lp, dim=1, descending=True, stable=True)
        return ids[:, :k], vals[:, :k]
    size = keep.sum(dim=1)
    width = int(size.max())
    if max_support is not None and width > max_support:
        raise ValueError(
            f"a sampling support holds {width} tokens, more than max_support={max_support} (lower top_k/top_p "
            "or raise max_support; supports are never truncated)"
        )
    vals, ids = torch.sort(lq, dim=1, descending=True, stable=True)
    vals, ids = vals[:, :width], ids[:, :width]
    inside = torch.arange(width, device=lq.device)[None, :] < size[:, None]
    return ids.masked_fill(~inside, -1), vals.masked_fill(~inside, float("-inf"))
