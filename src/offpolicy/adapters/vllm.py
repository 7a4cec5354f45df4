"""vLLM adapter: request fields for each recording mode and parsers for vLLM's three response shapes, into
the :class:`~offpolicy.adapters.common.TurnRecord` contract with the same semantic checks as the SGLang one.

What vLLM returns (documented in vLLM's "Sampling Mask (Distribution Replay)" guide and its protocol code):

* log-probs: ``SamplingParams.logprobs = K`` returns, per generated token, the sampled token and the top-K
  tokens with their log-probs. *Which* log-probs is a server setting, ``--logprobs-mode``:
  ``raw_logprobs`` (the default: before temperature and filtering), ``processed_logprobs`` (after temperature,
  penalties and top-k/top-p, so renormalised over the kept set, ``-inf`` outside it), ``raw_logits`` and
  ``processed_logits``. Off-policy correction needs the distribution the token was drawn from:
  ``processed_logprobs``. ``raw_logprobs`` equals it only at temperature 1 without filtering; the logits modes
  are refused.
* sampling mask: with ``--enable-return-sampling-mask`` (vllm-project/vllm#49577; Model Runner V2, no
  speculative decoding, ``temperature > 0``, ``top_k > 0`` to bound the mask) each generated token carries the
  list of token ids that survived filtering: ``CompletionOutput.sampling_mask.token_ids[t]`` offline and
  ``choices[i].sampling_mask[t]`` from ``/inference/v1/generate``. vLLM returns no support probabilities, so a
  support record takes them from the processed top-K log-probs: request ``logprobs >= top_k`` (this adapter
  sets ``logprobs = top_k``; the server's ``--max-logprobs``, default 20, must allow it) and every support id
  must come back with a finite log-prob. vLLM keeps every token tied with the k-th logit, so a support can
  exceed ``top_k``; a missing log-prob is then an error, never a silent truncation.
* JSON cannot hold ``-inf``: vLLM's OpenAI-style serialisers clamp log-probs at ``-9999.0``; values at or
  below that are read as ``-inf`` (probability 0) here.

Response shapes parsed:

``/inference/v1/generate`` (token in, token out; :func:`parse_generate_response`)
    ``{"choices": [{"token_ids": [...], "logprobs": {"content": [{"token": "token_id:17", "logprob": ...,
    "top_logprobs": [{"token": "token_id:3", "logprob": ...}, ...]}, ...]}, "sampling_mask": [[...], ...],
    "finish_reason": ...}]}``. Tokens are rendered as ``"token_id:<id>"`` (the generate endpoint's
    ``return_as_token_id`` rendering).
``/v1/completions`` with ``return_tokens_as_token_ids=true`` (:func:`parse_completion_response`)
    ``choices[i].logprobs = {"tokens": ["token_id:17", ...], "token_logprobs": [...], "top_logprobs":
    [{"token_id:3": -0.1, ...}, ...]}`` (and ``choices[i].sampling_mask`` when returned).
offline ``LLM.generate`` (:func:`parse_request_output`)
    ``RequestOutput.outputs[i]``: ``token_ids``, ``logprobs`` (one ``{token_id: Logprob(logprob, rank,
    decoded_token)}`` dict per token) and ``sampling_mask`` (``.token_ids``, a list per token).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from offpolicy.adapters.common import (
    RecordError,
    TurnRecord,
    check_logprob_values,
    check_sampled_possible,
    check_support_rows,
    check_temperature,
    head_record,
)
from offpolicy.records.candidates import Candidates

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")
#: vLLM's JSON clamp for -inf log-probs.
JSON_NEG_INF = -9999.0
#: vLLM's default ``--max-logprobs``.
DEFAULT_MAX_LOGPROBS = 20


def _top_k_value(top_k: int | None) -> int | None:
    if top_k is None or top_k in (-1, 0):
        return None
    if int(top_k) != top_k or top_k < 1:
        raise ValueError(f"top_k must be None, 0 / -1 (off) or an integer >= 1, got {top_k!r}")
    return int(top_k)


def build_sampling_params(
    *,
    max_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int | None = None,
    record: str | None = "head",
    logprobs: int | None = None,
    seed: int | None = None,
    max_logprobs: int = DEFAULT_MAX_LOGPROBS,
) -> dict:
    """``vllm.SamplingParams`` keyword arguments for a recording mode (also the HTTP ``sampling_params``).

    ``record="head"``: unfiltered, ``logprobs = K`` (default 8). ``record="support"``: needs ``top_k`` (vLLM's
    mask requires it), ``logprobs = top_k``; the server needs ``--enable-return-sampling-mask``,
    ``--logprobs-mode processed_logprobs`` and ``--max-logprobs >= top_k`` (``max_logprobs`` here is checked
    against it).
    """
    check_temperature(temperature)
    top_k = _top_k_value(top_k)
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if record not in ("head", "support", None):
        raise ValueError(f"record must be 'head', 'support' or None, got {record!r}")
    filtered = top_k is not None or top_p < 1.0
    if record in ("head", None) and filtered:
        raise ValueError(f"record={record!r} needs unfiltered sampling (top_p=1, top_k off); use record='support'")
    if record == "support":
        if top_k is None:
            raise ValueError("vLLM's sampling mask requires top_k > 0 (it bounds the mask); pass top_k")
        if logprobs is not None and logprobs < top_k:
            raise ValueError(f"logprobs={logprobs} < top_k={top_k}: support log-probs would be missing")
        logprobs = top_k if logprobs is None else int(logprobs)
    elif record == "head":
        logprobs = 8 if logprobs is None else int(logprobs)
        if logprobs < 1:
            raise ValueError(f"logprobs must be >= 1 for a head record, got {logprobs}")
    else:
        logprobs = 0
    if logprobs > max_logprobs:
        raise ValueError(f"logprobs={logprobs} exceeds the server's --max-logprobs={max_logprobs}; raise it")
    sp: dict[str, object] = {"max_tokens": int(max_tokens), "temperature": float(temperature),
                             "top_p": float(top_p), "logprobs": int(logprobs)}
    if top_k is not None:
        sp["top_k"] = top_k
    if seed is not None:
        sp["seed"] = int(seed)
    return sp


def build_request(token_ids: Sequence[int], *, model: str | None = None, **kwargs: object) -> dict:
    """The JSON body of a ``/inference/v1/generate`` request; ``kwargs`` go to :func:`build_sampling_params`."""
    ids = [int(t) for t in token_ids]
    if not ids:
        raise ValueError("token_ids must hold at least one token")
    body: dict[str, object] = {"token_ids": ids, "sampling_params": build_sampling_params(**kwargs),
                               "stream": False}
    if model is not None:
        body["model"] = model
    return body


def _token_id(token: str) -> int:
    if not isinstance(token, str) or not token.startswith("token_id:"):
        raise RecordError(
            f"token {token!r} is not rendered as 'token_id:<id>': request it so (return_tokens_as_token_ids) "
            "to recover ids without a tokenizer"
        )
    return int(token[len("token_id:"):])


def _lp(value: object) -> float:
    v = float("-inf") if value is None else float(value)
    return float("-inf") if v <= JSON_NEG_INF else v


def _record(
    sampled: list[int],
    sampled_lp: list[float],
    tops: list[dict[int, float]],
    masks: Sequence[Sequence[int]] | None,
    sp: Mapping[str, object],
    logprobs_mode: str,
    input_ids: Sequence[int] | None,
    finish: object,
    vocab_size: int | None,
    where: str,
) -> TurnRecord:
    """Build and check a record from per-token (sampled id, its log-prob, {id: log-prob} of the returned top)."""
    if logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
    if logprobs_mode.endswith("logits"):
        raise RecordError(f"{where}: --logprobs-mode {logprobs_mode} returns logits, not log-probabilities")
    temperature = float(sp.get("temperature", 1.0))
    top_p = float(sp.get("top_p", 1.0))
    top_k = _top_k_value(sp.get("top_k"))
    check_temperature(temperature)
    filtered = top_k is not None or top_p < 1.0
    if logprobs_mode == "raw_logprobs" and (filtered or temperature != 1.0):
        raise RecordError(
            f"{where}: --logprobs-mode raw_logprobs returns log-probs before temperature ({temperature}) and "
            f"filtering (top_p={top_p}, top_k={top_k}): not the distribution the tokens were drawn from; run the "
            "server with --logprobs-mode processed_logprobs"
        )
    n = len(sampled)
    tokens = torch.tensor(sampled, dtype=torch.int64)
    if vocab_size is not None and n and (int(tokens.max()) >= vocab_size or int(tokens.min()) < 0):
        raise RecordError(f"{where}: output token ids outside [0, {vocab_size})")
    lq = torch.tensor(sampled_lp, dtype=torch.float32)
    check_logprob_values(lq, f"{where} sampled log-probs")
    for t in range(n):
        if sampled[t] in tops[t] and abs(tops[t][sampled[t]] - sampled_lp[t]) > 1e-4:
            raise RecordError(f"{where}: token {t}: the sampled log-prob and its top entry differ")
    if masks is None and filtered:
        raise RecordError(
            f"{where}: the request filtered (top_p={top_p}, top_k={top_k}) but no sampling_mask came back: start "
            "the server with --enable-return-sampling-mask and parse a support record"
        )
    cands = None
    if masks is not None:
        if len(masks) != n:
            raise RecordError(f"{where}: sampling_mask holds {len(masks)} rows for {n} tokens")
        width = max((len(m) for m in masks), default=0)
        ids = torch.full((n, width), -1, dtype=torch.int64)
        lps = torch.full((n, width), float("-inf"))
        for t, m in enumerate(masks):
            if sampled[t] not in set(int(v) for v in m):
                raise RecordError(f"{where}: sampled token {sampled[t]} at position {t} is outside its support")
            known = {**tops[t], sampled[t]: sampled_lp[t]}
            missing = [int(v) for v in m if not math.isfinite(known.get(int(v), float("-inf")))]
            if missing:
                raise RecordError(
                    f"{where}: token {t}: support ids {missing[:5]} came back without a finite log-prob; request "
                    f"logprobs >= the support size ({len(m)}; ties at the k-th logit can exceed top_k)"
                )
            outside = [i for i, v in known.items() if math.isfinite(v) and i not in set(int(x) for x in m)]
            if outside:
                raise RecordError(
                    f"{where}: token {t}: ids {outside[:5]} have finite log-probs but lie outside the sampling "
                    "mask: the log-probs are full-vocabulary (raw_logprobs), not renormalised over the support"
                )
            ids[t, : len(m)] = torch.tensor([int(v) for v in m], dtype=torch.int64)
            lps[t, : len(m)] = torch.tensor([known[int(v)] for v in m])
        check_logprob_values(lps, f"{where} support log-probs")
        cands = Candidates(ids, lps, "support")
        check_support_rows(cands, tokens, lq, where)
        if vocab_size is not None:
            cands.validate(vocab_size, n, tokens)
    elif int(sp.get("logprobs") or 0) > 0:
        width = min(max((len(tp) for tp in tops), default=0), int(sp["logprobs"]))
        ids = torch.full((n, width), -1, dtype=torch.int64)
        lps = torch.full((n, width), float("-inf"))
        k = int(sp["logprobs"])
        for t, tp in enumerate(tops):
            # the head is the top-K by value; vLLM adds the sampled token as a (K+1)-th entry when it is not
            # among them, and a head that depends on the draw would bias score centering, so that one is dropped
            order = sorted(tp.items(), key=lambda kv: (-kv[1], kv[0]))[:k]
            if order:
                ids[t, : len(order)] = torch.tensor([i for i, _ in order], dtype=torch.int64)
                lps[t, : len(order)] = torch.tensor([v for _, v in order])
        cands = head_record(ids, lps, tokens, lq, where, "top log-probs", vocab_size)
    check_sampled_possible(lq, where)
    return TurnRecord(
        input_ids=tuple(int(t) for t in input_ids) if input_ids is not None else None, tokens=tokens,
        sampler_logprobs=lq, candidates=cands, temperature=temperature, top_p=top_p, top_k=top_k, versions=None,
        finish_reason=finish,
    )


def _mask_rows(mask: object) -> list[list[int]] | None:
    if mask is None:
        return None
    rows = mask.token_ids if hasattr(mask, "token_ids") else mask
    return [[int(v) for v in r] for r in rows]


def _choice(response: Mapping[str, object], index: int) -> Mapping[str, object]:
    choices = response.get("choices")
    if not isinstance(choices, Sequence) or not choices:
        raise RecordError("response has no choices")
    for c in choices:
        if int(c.get("index", 0)) == index:
            return c
    raise RecordError(f"response has no choice with index {index}")


def parse_generate_response(
    response: Mapping[str, object],
    request: Mapping[str, object],
    *,
    logprobs_mode: str = "processed_logprobs",
    vocab_size: int | None = None,
    choice: int = 0,
) -> TurnRecord:
    """Parse a ``/inference/v1/generate`` response. ``logprobs_mode`` is the server's ``--logprobs-mode``."""
    c = _choice(response, choice)
    sp = request.get("sampling_params") or {}
    token_ids = [int(t) for t in (c.get("token_ids") or [])]
    content = (c.get("logprobs") or {}).get("content") if c.get("logprobs") else None
    if content is None:
        raise RecordError("the choice carries no logprobs.content (request sampling_params.logprobs)")
    if len(content) != len(token_ids):
        raise RecordError(f"logprobs.content holds {len(content)} entries for {len(token_ids)} token_ids")
    sampled, sampled_lp, tops = [], [], []
    for t, item in enumerate(content):
        tid = _token_id(item["token"])
        if tid != token_ids[t]:
            raise RecordError(f"token {t}: logprobs entry {tid} differs from token_ids {token_ids[t]}")
        sampled.append(tid)
        sampled_lp.append(_lp(item["logprob"]))
        tops.append({_token_id(e["token"]): _lp(e["logprob"]) for e in (item.get("top_logprobs") or [])})
    return _record(sampled, sampled_lp, tops, _mask_rows(c.get("sampling_mask")), sp, logprobs_mode,
                   request.get("token_ids"), c.get("finish_reason"), vocab_size, "vLLM generate")


def parse_completion_response(
    response: Mapping[str, object],
    request: Mapping[str, object],
    *,
    logprobs_mode: str = "processed_logprobs",
    vocab_size: int | None = None,
    choice: int = 0,
) -> TurnRecord:
    """Parse a ``/v1/completions`` response made with ``return_tokens_as_token_ids=true``.

    ``request`` holds the sampling fields at top level (``temperature``, ``top_p``, ``top_k``, ``logprobs``)
    as the completions API takes them, and ``prompt`` as token ids.
    """
    c = _choice(response, choice)
    lp = c.get("logprobs")
    if not isinstance(lp, Mapping):
        raise RecordError("the choice carries no logprobs (request logprobs=K)")
    toks, vals = lp.get("tokens") or [], lp.get("token_logprobs") or []
    top = lp.get("top_logprobs") or [None] * len(toks)
    if not len(toks) == len(vals) == len(top):
        raise RecordError("logprobs.tokens / token_logprobs / top_logprobs lengths differ")
    sampled = [_token_id(t) for t in toks]
    tops = [{_token_id(k): _lp(v) for k, v in (d or {}).items()} for d in top]
    prompt = request.get("prompt")
    input_ids = prompt if isinstance(prompt, Sequence) and not isinstance(prompt, str) else None
    return _record(sampled, [_lp(v) for v in vals], tops, _mask_rows(c.get("sampling_mask")), request,
                   logprobs_mode, input_ids, c.get("finish_reason"), vocab_size, "vLLM completions")


def parse_request_output(
    output: object,
    sampling_params: Mapping[str, object],
    *,
    logprobs_mode: str = "processed_logprobs",
    vocab_size: int | None = None,
    choice: int = 0,
) -> TurnRecord:
    """Parse an offline ``vllm.RequestOutput`` (duck-typed: ``.outputs[i].token_ids / .logprobs /
    .sampling_mask`` and ``.prompt_token_ids``). ``sampling_params`` are the kwargs used (a dict)."""
    comp = output.outputs[choice]
    token_ids = [int(t) for t in comp.token_ids]
    steps = comp.logprobs
    if steps is None or len(steps) != len(token_ids):
        raise RecordError("CompletionOutput.logprobs must hold one dict per generated token (set logprobs)")
    sampled_lp, tops = [], []
    for t, step in enumerate(steps):
        d = {int(k): _lp(getattr(v, "logprob", v)) for k, v in step.items()}
        if token_ids[t] not in d:
            raise RecordError(f"token {t}: the sampled id {token_ids[t]} is missing from its logprobs dict")
        sampled_lp.append(d[token_ids[t]])
        tops.append(d)
    return _record(token_ids, sampled_lp, tops, _mask_rows(getattr(comp, "sampling_mask", None)),
                   sampling_params, logprobs_mode, getattr(output, "prompt_token_ids", None),
                   getattr(comp, "finish_reason", None), vocab_size, "vLLM offline")
