"""SGLang adapter: build ``/generate`` request bodies for each recording mode and parse responses into the
:class:`~offpolicy.adapters.common.TurnRecord` contract, checking the semantics the correction relies on.

Written against SGLang 0.5.23 (``pip install --no-deps sglang==0.5.23``), whose native ``/generate`` endpoint
takes token ids in and returns ``{"text", "output_ids", "meta_info"}``. Recording modes:

``head`` (unfiltered sampling: ``top_p = 1``, ``top_k`` off)
    ``return_logprob=True``, ``top_logprobs_num=K``, ``logprob_start_len=-1`` (output tokens only).
    ``meta_info.output_token_logprobs[t] = [logprob, token_id, text|null]`` is the sampled token's log-prob and
    ``meta_info.output_top_logprobs[t]`` the top-K ``[logprob, token_id, text|null]`` entries, both from
    ``log softmax(z / T)`` over the full vocabulary (SGLang's sampler returns post-temperature log-probs unless
    the server runs with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``, which must stay unset).

``support`` (filtered sampling: ``top_p < 1`` and/or ``top_k``)
    ``return_sampling_mask=True``, ``sampling_logprobs_mode="support"`` (plus ``return_logprob=True`` for the
    cross-checks). ``meta_info.output_token_sampling_mask[t]`` lists the realised support ``S_t`` (token ids,
    most probable first) and ``meta_info.output_token_sampling_logprobs[t]`` the log-probs over it,
    renormalised (``log(w / sum_S w)``, summing to one). Upstream since sgl-project/sglang#27408 (merged
    2026-07), hardened by #36630 (capture the sampler's own support); the server flag
    ``--sampling-mask-max-tokens`` (default 4096) caps the support and 0.5.23's scheduler admits masks only
    with a finite ``top_k <= cap`` (so pure top-p requests get ``top_k = cap`` here; the returned support
    is always the one actually sampled from, never truncated: SGLang aborts the request instead).
    ``sampling_logprobs_mode="selected"`` returns only the sampled token's renormalised log-prob, which is
    not enough for a support record and is refused.
    The record is a :class:`~offpolicy.CSRCandidates` of the masks' ids, each token's support back to back
    (never padded to the widest one).

Weight versions: ``meta_info.weight_version`` (the server's ``--weight-version``, updated by the weight-sync
endpoints' ``weight_version`` argument) and, when weights changed during the request, ``weight_versions`` spans
``[{"version", "start", "end"}]`` over the output tokens; both are parsed into per-token versions.

Checks (each a :class:`~offpolicy.adapters.common.RecordError` naming the token): temperature 0; a filtered
request recorded as a head or without a support (full-vocabulary vs renormalised confusion); support rows not
summing to 1; a sampled token outside its support; full-vocabulary log-probs that are not post-temperature
(their offset to the support log-probs must be one constant per row); head mass above 1; disagreeing copies of
one token's log-prob; log-probs above 0 (logits); mismatched lengths; an aborted request; and every malformed
field (missing, of the wrong JSON type, a float or negative token id, overlapping or partial weight-version spans),
named. A malformed *request* body raises ``TypeError`` / ``ValueError`` naming its field.

Routing records (MoE models; docs/routing.md): a server started with ``--enable-return-routed-experts`` returns,
for a request with ``"return_routed_experts": true`` (:func:`build_request`'s ``return_routed_experts``),
``meta_info.routed_experts``: a base64 string of the raw little-endian bytes of an ``int32`` array, flat, in
``[positions, num_hidden_layers, num_experts_per_tok]`` order with one row per *forwarded* position, ``prompt +
output - 1`` of them (the last sampled token is never forwarded). Layout as read from sgl-project/sglang
``python/sglang/srt/layers/moe/routed_experts_capturer.py`` at commit d4d0fc58371761f9f0da007a4ef4f0ad2bd19658
(``get_routed_experts`` slices ``req_to_token[req_pool_idx][: seqlen - 1]`` of an ``int32`` host buffer
``[tokens, num_hidden_layers, num_experts_per_tok]``; ``extract_routed_experts_from_meta_info`` decodes with
``np.frombuffer(..., dtype=np.int32)``). A ``meta_info.routed_experts_dtype`` (``"int32"``, ``"uint16"``,
``"uint8"``), which some later revisions send, is honoured. The payload is flat, so the model's
``num_hidden_layers`` and ``top_k`` are arguments of :func:`parse_routed_experts`; layers the engine records but
that route nothing (DeepSeek's first dense layers: zeros) are left out with ``moe_layers``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from offpolicy.adapters.common import (
    RecordError,
    TurnRecord,
    check_calibration,
    check_logprob_values,
    check_sampled_possible,
    check_support_offsets,
    check_support_rows,
    RAW_ROUTE_DTYPES,
    check_temperature,
    csr_record,
    decode_base64,
    entry_at,
    head_record,
    json_field,
    json_float,
    json_int,
    json_list,
    json_mapping,
    output_routes,
    raw_int_array,
)
from offpolicy.records.candidates import Candidates
from offpolicy.records.routed_experts import RoutedExperts

SGLANG_VERSION = "0.5.23"
#: SGLang's default ``--sampling-mask-max-tokens``.
DEFAULT_SAMPLING_MASK_MAX_TOKENS = 4096
#: SGLang's "no top-k" value (``TOP_K_ALL = 1 << 30``); ``-1`` is accepted on input too.
TOP_K_ALL = 1 << 30


def _top_k_value(top_k: int | None) -> int | None:
    if top_k is None:
        return None
    top_k = json_int(top_k, "top_k", TypeError)
    if top_k in (-1, TOP_K_ALL):
        return None
    if top_k < 1:
        raise ValueError(f"top_k must be None, -1 or an integer >= 1, got {top_k!r}")
    return top_k


def build_request(
    input_ids: Sequence[int],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int | None = None,
    record: str | None = "head",
    top_logprobs_num: int | None = None,
    sampling_mask_max_tokens: int = DEFAULT_SAMPLING_MASK_MAX_TOKENS,
    sampling_seed: int | None = None,
    stop_token_ids: Sequence[int] | None = None,
    rid: str | None = None,
    extra_sampling_params: Mapping[str, object] | None = None,
    return_routed_experts: bool = False,
) -> dict:
    """The JSON body of one SGLang ``/generate`` request (token ids in).

    Args:
        input_ids: the full context (for multi-turn: ``Trajectory.input_ids``).
        max_new_tokens, temperature, top_p, top_k: sampling parameters (``top_k=None``: off).
        record: ``"head"`` (needs unfiltered sampling), ``"support"`` (needs filtering) or ``None`` (sampled
            token log-probs only, unfiltered sampling).
        top_logprobs_num: head width K (default 8); in support mode an optional number of full-vocabulary top
            log-probs to request for the post-temperature cross-check (default 2; 0 disables).
        sampling_mask_max_tokens: the server's ``--sampling-mask-max-tokens``; a support request without
            ``top_k`` uses it as ``top_k`` (SGLang 0.5.23 admits sampling masks only with a finite top-k).
        sampling_seed, stop_token_ids, rid: passed through.
        extra_sampling_params: more ``sampling_params`` fields (e.g. ``{"ignore_eos": True}``); they may not
            override the ones above.
        return_routed_experts: ask an MoE server (``--enable-return-routed-experts``) for the routing record
            (:func:`parse_routed_experts`).
    """
    check_temperature(temperature)
    top_k = _top_k_value(top_k)
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if record not in ("head", "support", None):
        raise ValueError(f"record must be 'head', 'support' or None, got {record!r}")
    ids = [int(t) for t in input_ids]
    if not ids:
        raise ValueError("input_ids must hold at least one token")
    filtered = top_k is not None or top_p < 1.0
    if record in ("head", None) and filtered:
        raise ValueError(
            f"record={record!r} needs unfiltered sampling (top_p=1, top_k off): SGLang's output_token_logprobs "
            "are full-vocabulary values, while a filtered sampler draws from the renormalised support; use "
            "record='support' (mask replay)"
        )
    if record == "support" and not filtered:
        raise ValueError("record='support' needs top_p < 1 or a top_k; unfiltered sampling uses record='head'")
    sp: dict[str, object] = {"max_new_tokens": int(max_new_tokens), "temperature": float(temperature),
                             "top_p": float(top_p)}
    body: dict[str, object] = {"input_ids": ids, "return_logprob": True, "logprob_start_len": -1}
    if record == "head":
        k = 8 if top_logprobs_num is None else int(top_logprobs_num)
        if k < 1:
            raise ValueError(f"top_logprobs_num must be >= 1 for a head record, got {top_logprobs_num!r}")
        body["top_logprobs_num"] = k
    elif record == "support":
        if top_k is None:
            top_k = int(sampling_mask_max_tokens)
        if top_k > sampling_mask_max_tokens:
            raise ValueError(
                f"SGLang {SGLANG_VERSION} admits return_sampling_mask only with top_k <= "
                f"--sampling-mask-max-tokens ({sampling_mask_max_tokens}); got top_k={top_k}"
            )
        k = 2 if top_logprobs_num is None else int(top_logprobs_num)
        if k > 0:
            body["top_logprobs_num"] = k
        body["return_sampling_mask"] = True
        body["sampling_logprobs_mode"] = "support"
    if top_k is not None:
        sp["top_k"] = top_k
    if sampling_seed is not None:
        sp["sampling_seed"] = int(sampling_seed)
    if stop_token_ids:
        sp["stop_token_ids"] = [int(t) for t in stop_token_ids]
    for key, value in (extra_sampling_params or {}).items():
        if key in sp:
            raise ValueError(f"extra_sampling_params may not override {key!r}")
        sp[key] = value
    body["sampling_params"] = sp
    if return_routed_experts:
        body["return_routed_experts"] = True
    if rid is not None:
        body["rid"] = rid
    return body


def validate_request(body: Mapping[str, object], vocab_size: int) -> bool:
    """Check a request body; with SGLang importable also against its own ``SamplingParams.verify``.

    Returns True when SGLang's own check ran, False when SGLang is not installed (our checks ran either way).
    Raises ``ValueError`` on an invalid body.
    """
    sp = body.get("sampling_params")
    if not isinstance(sp, Mapping):
        raise ValueError("body['sampling_params'] must be a dict")
    mode = body.get("sampling_logprobs_mode")
    if mode is not None and not body.get("return_sampling_mask"):
        raise ValueError("sampling_logprobs_mode can only be set when return_sampling_mask=true (as SGLang checks)")
    if mode not in (None, "selected", "support"):
        raise ValueError(f"sampling_logprobs_mode must be 'selected' or 'support', got {mode!r}")
    check_temperature(float(sp.get("temperature", 1.0)))
    if body.get("return_sampling_mask"):
        top_k = sp.get("top_k", TOP_K_ALL)
        if top_k is None or top_k in (-1, TOP_K_ALL) or int(top_k) < 1:
            raise ValueError(
                f"return_sampling_mask needs a finite top_k <= --sampling-mask-max-tokens (SGLang {SGLANG_VERSION}), "
                f"got {top_k}"
            )
    try:
        from sglang.srt.sampling.sampling_params import SamplingParams
    except ImportError:
        return False
    params = SamplingParams(**dict(sp))
    params.verify(vocab_size)
    return True


def _finish_type(meta: Mapping[str, object]) -> object:
    fr = meta.get("finish_reason")
    if isinstance(fr, Mapping) and fr.get("type") == "abort":
        raise RecordError(f"the request was aborted: {fr.get('message', fr)}")
    return fr


def _pairs(entries: object, what: str) -> tuple[list[float], list[int]]:
    """``[[logprob, token_id, text], ...]`` -> (logprobs, ids); a ``None`` log-probability is ``-inf``."""
    lps, ids = [], []
    for i, e in enumerate(json_list(entries, what)):
        if isinstance(e, (str, bytes, Mapping)) or not isinstance(e, Sequence) or len(e) < 2:
            raise RecordError(f"{what}[{i}]: expected a [logprob, token_id, text] entry, got {e!r}")
        lps.append(float("-inf") if e[0] is None else json_float(e[0], f"{what}[{i}] log-probability"))
        ids.append(_token_id(e[1], f"{what}[{i}] token id"))
    return lps, ids


def _token_id(value: object, what: str) -> int:
    """A token id of a response: an integer >= 0."""
    token = json_int(value, what)
    if token < 0:
        raise RecordError(f"{what} must be >= 0, got {token}")
    return token


def _versions(meta: Mapping[str, object], n: int) -> tuple[str, ...] | None:
    """Per-token weight versions from ``weight_versions`` spans ``[{"version", "start", "end"}]`` (disjoint,
    covering every output token) or the one ``weight_version``."""
    single = meta.get("weight_version")
    single = None if single is None else _version(single, "weight_version")
    spans = meta.get("weight_versions")
    if spans:
        out: list[str | None] = [None] * n
        for i, span in enumerate(json_list(spans, "weight_versions")):
            what = f"weight_versions[{i}]"
            span = json_mapping(span, what)
            start = json_int(json_field(span, "start", what), f"{what}.start")
            end = json_int(json_field(span, "end", what), f"{what}.end")
            version = _version(json_field(span, "version", what), f"{what}.version")
            if not 0 <= start <= end:
                raise RecordError(f"{what}: expected 0 <= start <= end, got start={start}, end={end}")
            for t in range(start, min(end, n)):
                if out[t] is not None:
                    raise RecordError(f"{what} overlaps another span at output token {t}")
                out[t] = version
        if any(v is None for v in out):
            raise RecordError(f"weight_versions spans {spans} do not cover all {n} output tokens")
        return tuple(out)  # type: ignore[arg-type]
    return None if single is None else (single,) * n


def _version(value: object, what: str) -> str:
    """A weight version as SGLang reports it (a string; an integer is accepted) -> str."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise RecordError(f"{what} must be a string (or an integer), got {value!r}")
    return str(value)


def parse_response(
    response: Mapping[str, object],
    request: Mapping[str, object],
    *,
    vocab_size: int | None = None,
    return_original_logprob: bool = False,
) -> TurnRecord:
    """Parse one ``/generate`` response (for the request body that produced it) into a :class:`TurnRecord`.

    Args:
        response: ``{"output_ids": [...], "meta_info": {...}, ...}`` as SGLang returns it.
        request: the body sent (from :func:`build_request`, or an equivalent dict).
        vocab_size: if given, ids are checked against it.
        return_original_logprob: set True if the server runs with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``
            (raw log-probs): then a head record at temperature != 1 is refused.

    Raises:
        RecordError: (a ``ValueError``) the response is malformed (a missing or mistyped field, named) or
            contradicts the record semantics (see the module docstring).
        TypeError / ValueError: the request body is malformed (the field is named).
    """
    request = json_mapping(request, "request", TypeError)
    response = json_mapping(response, "response")
    sp = json_mapping(request.get("sampling_params") or {}, "request sampling_params", TypeError)
    temperature = json_float(sp.get("temperature", 1.0), "request sampling_params.temperature", TypeError)
    top_p = json_float(sp.get("top_p", 1.0), "request sampling_params.top_p", TypeError)
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"request sampling_params.top_p must be in (0, 1], got {top_p!r}")
    top_k = _top_k_value(sp.get("top_k"))
    check_temperature(temperature)
    filtered = top_k is not None or top_p < 1.0
    meta = response.get("meta_info")
    if not isinstance(meta, Mapping):
        raise RecordError("response has no meta_info dict")
    finish = _finish_type(meta)
    if not request.get("return_logprob") and not request.get("return_sampling_mask"):
        raise RecordError("the request asked for no log-probs (return_logprob / return_sampling_mask)")

    full_lp = full_ids = None
    if request.get("return_logprob"):
        if "output_token_logprobs" not in meta:
            raise RecordError("meta_info lacks output_token_logprobs although return_logprob was set")
        full_lp, full_ids = _pairs(meta["output_token_logprobs"], "output_token_logprobs")
    tokens_list = full_ids
    if "output_ids" in response:
        tokens_list = [_token_id(t, f"output_ids[{i}]") for i, t in enumerate(json_list(response["output_ids"],
                                                                                         "output_ids"))]
    if tokens_list is None:
        raise RecordError("the response has neither output_ids nor output_token_logprobs")
    n = len(tokens_list)
    if full_ids is not None and full_ids != tokens_list:
        raise RecordError("output_token_logprobs token ids differ from output_ids")
    tokens = torch.tensor(tokens_list, dtype=torch.int64)
    if vocab_size is not None and n and (int(tokens.max()) >= vocab_size or int(tokens.min()) < 0):
        raise RecordError(f"output token ids outside [0, {vocab_size})")
    where = f"SGLang response {meta.get('id', '')}".strip()

    top = None
    if request.get("top_logprobs_num"):
        rows = meta.get("output_top_logprobs")
        if rows is None or len(json_list(rows, "output_top_logprobs")) != n:
            raise RecordError(f"{where}: output_top_logprobs must hold one list per output token ({n})")
        top = [_pairs(r or [], f"output_top_logprobs[{t}]") for t, r in enumerate(rows)]

    mode = request.get("sampling_logprobs_mode") if request.get("return_sampling_mask") else None
    if request.get("return_sampling_mask") and mode != "support":
        raise RecordError(
            f"{where}: sampling_logprobs_mode={mode!r} returns only the sampled token's renormalised log-prob; "
            "a support record needs sampling_logprobs_mode='support'"
        )
    if mode is None and filtered:
        raise RecordError(
            f"{where}: the request filtered (top_p={top_p}, top_k={top_k}) but recorded no sampling support: "
            "output_token_logprobs are full-vocabulary log-probs, not the renormalised distribution the tokens "
            "were drawn from. Use build_request(record='support')."
        )

    if mode == "support":
        masks = meta.get("output_token_sampling_mask")
        slps = meta.get("output_token_sampling_logprobs")
        if masks is None or slps is None:
            raise RecordError(f"{where}: meta_info lacks output_token_sampling_mask / _logprobs")
        masks = [json_list(m, f"output_token_sampling_mask[{t}]")
                 for t, m in enumerate(json_list(masks, "output_token_sampling_mask"))]
        slps = json_list(slps, "output_token_sampling_logprobs")
        if len(masks) != n or len(slps) != n:
            raise RecordError(f"{where}: sampling mask / log-probs hold {len(masks)} / {len(slps)} rows for {n} tokens")
        rows, vals = [], []
        for t, (m, lp) in enumerate(zip(masks, slps)):
            if isinstance(lp, (str, bytes, Mapping)) or not isinstance(lp, Sequence) or len(lp) != len(m):
                raise RecordError(f"{where}: token {t}: output_token_sampling_logprobs[{t}] must be a list aligned "
                                  "with the sampling mask")
            rows.append([_token_id(v, f"output_token_sampling_mask[{t}][{j}]") for j, v in enumerate(m)])
            vals.append([json_float(v, f"output_token_sampling_logprobs[{t}][{j}]") for j, v in enumerate(lp)])
        cands = csr_record(rows, vals)  # each token's realised support, back to back: never [T, K_max]
        check_logprob_values(cands.logprobs, f"{where} output_token_sampling_logprobs")
        lq = entry_at(cands, tokens)[1]
        check_support_rows(cands, tokens, lq, where)
        if vocab_size is not None:
            cands.validate(vocab_size, n, tokens)
        if full_lp is not None and not return_original_logprob:
            fi = [[i] + (top[t][1] if top else []) for t, i in enumerate(tokens_list)]
            fl = [[v] + (top[t][0] if top else []) for t, v in enumerate(full_lp)]
            w = max((len(r) for r in fi), default=0)
            fid = torch.tensor([r + [-1] * (w - len(r)) for r in fi], dtype=torch.int64).reshape(n, w)
            flp = torch.tensor([r + [float("-inf")] * (w - len(r)) for r in fl]).reshape(n, w)
            check_logprob_values(flp, f"{where} output_token_logprobs")
            check_support_offsets(cands, fid, flp, where)
    else:
        if full_lp is None:
            raise RecordError(f"{where}: no sampled-token log-probs (set return_logprob)")
        if return_original_logprob and temperature != 1.0:
            raise RecordError(
                f"{where}: the server returns raw (pre-temperature) log-probs (SGLANG_RETURN_ORIGINAL_LOGPROB) but "
                f"sampled at temperature {temperature}: the recorded q is not the sampling distribution"
            )
        lq = torch.tensor(full_lp)
        check_logprob_values(lq, f"{where} output_token_logprobs")
        cands = None
        if top is not None:
            width = max((len(r[1]) for r in top), default=0)
            ids = torch.full((n, width), -1, dtype=torch.int64)
            lps = torch.full((n, width), float("-inf"))
            for t, (lp, ii) in enumerate(top):
                ids[t, : len(ii)] = torch.tensor(ii, dtype=torch.int64)
                lps[t, : len(lp)] = torch.tensor(lp)
            cands = head_record(ids, lps, tokens, lq, where, "output_top_logprobs", vocab_size)
    check_sampled_possible(lq, where)
    input_ids = request.get("input_ids")
    if input_ids is not None:
        input_ids = tuple(json_int(t, f"request input_ids[{i}]", TypeError)
                          for i, t in enumerate(json_list(input_ids, "request input_ids", TypeError)))
    return TurnRecord(
        input_ids=input_ids,
        tokens=tokens, sampler_logprobs=lq.float(), candidates=cands, temperature=temperature, top_p=top_p,
        top_k=top_k, versions=_versions(meta, n), finish_reason=finish,
    )


def parse_batch(
    responses: Sequence[Mapping[str, object]],
    requests: Sequence[Mapping[str, object]],
    *,
    vocab_size: int | None = None,
    return_original_logprob: bool = False,
    calibration_z: float | None = 6.0,
) -> list[TurnRecord]:
    """Parse many responses; for head records also run :func:`check_calibration` over all their tokens.

    ``calibration_z=None`` disables the statistical check (it needs a few hundred tokens to have power).
    """
    if len(responses) != len(requests):
        raise ValueError(f"{len(responses)} responses for {len(requests)} requests")
    recs = [parse_response(r, q, vocab_size=vocab_size, return_original_logprob=return_original_logprob)
            for r, q in zip(responses, requests)]
    heads = [r for r in recs if r.kind == "head"]
    if heads and calibration_z is not None:
        width = max(r.candidates.width for r in heads)
        pad = torch.nn.functional.pad
        ids = torch.cat([pad(r.candidates.ids, (0, width - r.candidates.width), value=-1) for r in heads])
        lps = torch.cat([pad(r.candidates.logprobs, (0, width - r.candidates.width), value=float("-inf"))
                         for r in heads])
        check_calibration(torch.cat([r.tokens for r in heads]), Candidates(ids, lps, "head"), calibration_z)
    return recs


def parse_routed_experts(
    response: Mapping[str, object],
    request: Mapping[str, object],
    *,
    num_experts: int,
    num_hidden_layers: int,
    top_k: int,
    moe_layers: Sequence[int] | None = None,
    num_layers: int | None = None,
) -> RoutedExperts:
    """The routing record of one ``/generate`` response's sampled tokens (``T`` rows, row ``t`` the position that
    predicted output token ``t``), from ``meta_info.routed_experts`` (layout in the module docstring).

    Args:
        response, request: as for :func:`parse_response`; the request's ``input_ids`` give the prompt length
            (``meta_info.prompt_tokens``, when present, must agree), ``output_ids`` the sampled tokens.
        num_experts: routed experts per layer (ids are checked in ``[0, num_experts)``).
        num_hidden_layers, top_k: the model's ``num_hidden_layers`` and ``num_experts_per_tok``, the payload's
            row shape.
        moe_layers: indices of the MoE layers among the ``num_hidden_layers`` (None: all).
        num_layers: the model's MoE layer count, checked after ``moe_layers``.

    Raises:
        RecordError: the field is missing, not base64, of a size that is not a whole number of
            ``[num_hidden_layers, top_k]`` rows, of the wrong number of positions, or holds an invalid route (id out
            of range, an expert twice in a token-layer, a layer without a route), each naming the field.
    """
    request = json_mapping(request, "request", TypeError)
    response = json_mapping(response, "response")
    meta = response.get("meta_info")
    if not isinstance(meta, Mapping):
        raise RecordError("response has no meta_info dict")
    _finish_type(meta)
    where = f"SGLang response {meta.get('id', '')}".strip()
    positions = _route_rows(meta, where, num_hidden_layers, top_k)
    input_ids = request.get("input_ids")
    if input_ids is None:
        raise RecordError(f"{where}: the request has no input_ids, so the prompt length is unknown")
    prompt_len = len(json_list(input_ids, "request input_ids", TypeError))
    if "prompt_tokens" in meta and json_int(meta["prompt_tokens"], "meta_info.prompt_tokens") != prompt_len:
        raise RecordError(f"{where}: meta_info.prompt_tokens = {meta['prompt_tokens']} differs from the request's "
                          f"{prompt_len} input_ids")
    if "output_ids" in response:
        n = len(json_list(response["output_ids"], "output_ids"))
    elif "output_token_logprobs" in meta:
        n = len(json_list(meta["output_token_logprobs"], "output_token_logprobs"))
    else:
        raise RecordError(f"{where}: the response has neither output_ids nor output_token_logprobs")
    return output_routes(positions, prompt_len, n, num_experts=num_experts, moe_layers=moe_layers, where=where,
                         field="meta_info.routed_experts", num_layers=num_layers)


def routed_positions(response: Mapping[str, object], *, num_hidden_layers: int, top_k: int) -> Tensor:
    """Every forwarded position's routes of one ``/generate`` response, ``[prompt + output - 1, num_hidden_layers,
    top_k]`` int64 (row ``s`` the position whose input is token ``s`` of prompt + output), decoded from
    ``meta_info.routed_experts``: the rows :func:`parse_routed_experts` slices the sampled tokens' from, and what
    :func:`offpolicy.diagnose.route_file.save_engine_routes` lays out per context for ``offpolicy diagnose
    --routes``. Raises :class:`RecordError` naming the field."""
    response = json_mapping(response, "response")
    meta = response.get("meta_info")
    if not isinstance(meta, Mapping):
        raise RecordError("response has no meta_info dict")
    return _route_rows(meta, f"SGLang response {meta.get('id', '')}".strip(), num_hidden_layers, top_k)


def _route_rows(meta: Mapping[str, object], where: str, num_hidden_layers: int, top_k: int) -> Tensor:
    for name, v in (("num_hidden_layers", num_hidden_layers), ("top_k", top_k)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    if "routed_experts" not in meta or meta["routed_experts"] is None:
        raise RecordError(f"{where}: meta_info lacks routed_experts (send return_routed_experts=true to a server "
                          "started with --enable-return-routed-experts)")
    dtype = meta.get("routed_experts_dtype", "int32")
    if dtype not in RAW_ROUTE_DTYPES:
        raise RecordError(f"{where}: meta_info.routed_experts_dtype {dtype!r} is not one of {sorted(RAW_ROUTE_DTYPES)}")
    flat = raw_int_array(decode_base64(meta["routed_experts"], f"{where}: meta_info.routed_experts"),
                         RAW_ROUTE_DTYPES[dtype], f"{where}: meta_info.routed_experts")
    row = num_hidden_layers * top_k
    if flat.numel() % row:
        raise RecordError(f"{where}: meta_info.routed_experts holds {flat.numel()} ids, not a whole number of "
                          f"[num_hidden_layers={num_hidden_layers}, top_k={top_k}] rows ({row} ids each)")
    return flat.view(-1, num_hidden_layers, top_k).to(torch.int64)
