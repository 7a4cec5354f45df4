"""SGLang adapter: request fields per mode (validated by SGLang's own SamplingParams), response parsing into the
record contract, the semantic checks, multi-turn trajectories."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import offpolicy as op
from offpolicy.adapters import RecordError, Trajectory, check_calibration, collate
from offpolicy.adapters import sglang
from offpolicy.fleet.sampler import support_mask

from support.engine_fixtures import fake, load


def true_record(context, tokens, temperature, top_p=1.0, top_k=None):
    """Post-temperature full log-probs and support-renormalised log-probs of each generated token."""
    ctx, full, renorm, supports = list(context), [], [], []
    for y in tokens:
        lp = torch.log_softmax(fake.toy_logits(ctx).double() / temperature, -1)
        keep = support_mask(lp[None].float(), top_k, top_p)[0]
        full.append(float(lp[y]))
        renorm.append(float(lp[y] - torch.logsumexp(lp[keep], 0)))
        supports.append(set(keep.nonzero().flatten().tolist()))
        ctx.append(y)
    return torch.tensor(full, dtype=torch.float64), torch.tensor(renorm, dtype=torch.float64), supports


# ---------------------------------------------------------------- requests
def test_build_request_fields_per_mode():
    head = sglang.build_request([1, 2], max_new_tokens=5, temperature=0.8, record="head", top_logprobs_num=4)
    assert head == {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": -1, "top_logprobs_num": 4,
                    "sampling_params": {"max_new_tokens": 5, "temperature": 0.8, "top_p": 1.0}}
    sup = sglang.build_request([1], max_new_tokens=3, top_p=0.95, top_k=64, record="support", sampling_seed=3)
    assert sup["return_sampling_mask"] is True and sup["sampling_logprobs_mode"] == "support"
    assert sup["top_logprobs_num"] == 2 and sup["sampling_params"]["top_k"] == 64
    assert sup["sampling_params"]["sampling_seed"] == 3
    pure_p = sglang.build_request([1], max_new_tokens=3, top_p=0.9, record="support", top_logprobs_num=0)
    assert pure_p["sampling_params"]["top_k"] == sglang.DEFAULT_SAMPLING_MASK_MAX_TOKENS
    assert "top_logprobs_num" not in pure_p
    plain = sglang.build_request([1], max_new_tokens=2, record=None, stop_token_ids=[0])
    assert "top_logprobs_num" not in plain and plain["sampling_params"]["stop_token_ids"] == [0]


@pytest.mark.parametrize("kwargs,match", [
    ({"temperature": 0.0}, "temperature 0"),
    ({"top_p": 0.9, "record": "head"}, "unfiltered"),
    ({"top_k": 5, "record": None}, "unfiltered"),
    ({"record": "support"}, "needs top_p < 1"),
    ({"top_k": 5000, "record": "support"}, "sampling-mask-max-tokens"),
    ({"top_p": 1.5}, "top_p"),
    ({"record": "head", "top_logprobs_num": 0}, "top_logprobs_num"),
    ({"extra_sampling_params": {"temperature": 2.0}}, "override"),
])
def test_build_request_refuses(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sglang.build_request([1], max_new_tokens=2, **kwargs)


def test_requests_validate_against_sglang_sampling_params():
    pytest.importorskip("sglang.srt.sampling.sampling_params")
    for body in (
        sglang.build_request([1, 2], max_new_tokens=5, temperature=0.8, record="head"),
        sglang.build_request([1], max_new_tokens=3, top_p=0.95, top_k=64, record="support"),
        sglang.build_request([1], max_new_tokens=3, top_p=0.9, record="support",
                             extra_sampling_params={"ignore_eos": True}),
    ):
        assert sglang.validate_request(body, vocab_size=1000) is True
    bad = sglang.build_request([1], max_new_tokens=3, record="head")
    bad["sampling_params"]["top_p"] = 1.5
    with pytest.raises(ValueError, match="top_p"):
        sglang.validate_request(bad, vocab_size=1000)
    bad = sglang.build_request([1], max_new_tokens=3, record="head")
    bad["sampling_params"]["min_new_tokens"] = 9
    with pytest.raises(ValueError, match="min_new_tokens"):
        sglang.validate_request(bad, vocab_size=1000)
    bad = sglang.build_request([1], max_new_tokens=3, record="head")
    bad["sampling_logprobs_mode"] = "support"
    with pytest.raises(ValueError, match="return_sampling_mask=true"):
        sglang.validate_request(bad, vocab_size=1000)
    nok = sglang.build_request([1], max_new_tokens=3, top_p=0.9, top_k=5, record="support")
    del nok["sampling_params"]["top_k"]
    with pytest.raises(ValueError, match="finite top_k"):
        sglang.validate_request(nok, vocab_size=1000)


# ---------------------------------------------------------------- fixtures
def test_parse_head_fixture():
    req, resp = load("sglang_head_request.json"), load("sglang_head_response.json")
    rec = sglang.parse_response(resp, req, vocab_size=fake.V)
    assert rec.tokens.tolist() == resp["output_ids"] and rec.kind == "head"
    assert rec.candidates.ids.shape == (6, 4) and rec.versions == ("7",) * 6
    full, _, _ = true_record(req["input_ids"], resp["output_ids"], 0.8)
    # fp32 server values against a float64 recompute: 1e-5
    assert torch.allclose(rec.sampler_logprobs.double(), full, atol=1e-5)
    assert rec.finish_reason == {"type": "length", "length": 6}
    assert rec.input_ids == tuple(req["input_ids"])


def test_parse_support_fixture_with_weight_version_spans():
    req, resp = load("sglang_support_request.json"), load("sglang_support_response.json")
    rec = sglang.parse_response(resp, req, vocab_size=fake.V)
    assert rec.kind == "support" and rec.versions == ("6", "6", "6", "7", "7", "7")
    _, renorm, supports = true_record(req["input_ids"], resp["output_ids"], 0.7, 0.9, 8)
    assert torch.allclose(rec.sampler_logprobs.double(), renorm, atol=1e-5)
    c = rec.candidates
    assert isinstance(c, op.CSRCandidates) and c.lengths.tolist() == [len(s) for s in supports]
    assert [set(r.tolist()) for r in c.ids.split(c.lengths.tolist())] == supports
    rec.candidates.validate(fake.V, len(rec), rec.tokens)
    assert rec.top_p == 0.9 and rec.top_k == 8 and rec.temperature == 0.7


# ---------------------------------------------------------------- failure modes
def fresh(body, **kw):
    return fake.sglang_generate(body, torch.Generator().manual_seed(5), **kw)


SUP = sglang.build_request([2, 7, 1, 8], max_new_tokens=6, temperature=0.7, top_p=0.9, top_k=8,
                           record="support", top_logprobs_num=3)
HEAD = sglang.build_request([3, 1, 4], max_new_tokens=6, temperature=0.6, record="head", top_logprobs_num=4)


def test_raw_vs_post_temperature_logprobs_detected():
    with pytest.raises(RecordError, match="post-temperature"):
        sglang.parse_response(fresh(SUP, raw_logprobs=True), SUP)
    # at temperature 1 raw and post-temperature coincide: nothing to flag
    t1 = copy.deepcopy(SUP)
    t1["sampling_params"]["temperature"] = 1.0
    sglang.parse_response(fresh(t1, raw_logprobs=True), t1)
    with pytest.raises(RecordError, match="SGLANG_RETURN_ORIGINAL_LOGPROB"):
        sglang.parse_response(fresh(HEAD, raw_logprobs=True), HEAD, return_original_logprob=True)


def test_renormalised_vs_full_vocabulary_confusion_detected():
    with pytest.raises(RecordError, match="not 1"):
        sglang.parse_response(fresh(SUP, renormalised_full=True), SUP)
    filtered_plain = copy.deepcopy(HEAD)
    filtered_plain["sampling_params"]["top_p"] = 0.9
    with pytest.raises(RecordError, match="full-vocabulary"):
        sglang.parse_response(fresh(filtered_plain), filtered_plain)
    resp = fresh(HEAD)
    top = resp["meta_info"]["output_top_logprobs"][2]
    z = math.log(sum(math.exp(e[0]) for e in top))
    for e in top:
        e[0] -= z  # top-K renormalised over itself: its copy of the sampled token no longer matches
    with pytest.raises(RecordError, match="differ"):
        sglang.parse_response(resp, HEAD)
    for e in top:
        e[0] += math.log(1.3)  # mass 1.3: not probabilities of one distribution at all
    resp["meta_info"]["output_token_logprobs"][2][0] = top[0][0] if top[0][1] == resp["output_ids"][2] else -9.0
    with pytest.raises(RecordError, match="> 1"):
        sglang.parse_response(resp, HEAD)


def test_support_row_sum_and_sampled_outside_support_detected():
    resp = fresh(SUP)
    masks = resp["meta_info"]["output_token_sampling_mask"]
    lps = resp["meta_info"]["output_token_sampling_logprobs"]
    t = next(i for i, m in enumerate(masks) if len(m) >= 2)
    y = resp["output_ids"][t]
    j = masks[t].index(y)
    del masks[t][j], lps[t][j]
    z = math.log(sum(math.exp(v) for v in lps[t]))
    lps[t] = [v - z for v in lps[t]]
    with pytest.raises(RecordError, match="outside its support"):
        sglang.parse_response(resp, SUP)
    resp = fresh(SUP)
    resp["meta_info"]["output_token_sampling_logprobs"][1] = [
        v - 0.5 for v in resp["meta_info"]["output_token_sampling_logprobs"][1]]
    with pytest.raises(RecordError, match="not 1"):
        sglang.parse_response(resp, SUP)


def test_other_refusals():
    zero = copy.deepcopy(HEAD)
    zero["sampling_params"]["temperature"] = 0.0
    with pytest.raises(RecordError, match="temperature 0"):
        sglang.parse_response(fresh(HEAD), zero)
    aborted = fresh(SUP)
    aborted["meta_info"]["finish_reason"] = {"type": "abort", "message": "Sampling support exceeds"}
    with pytest.raises(RecordError, match="aborted"):
        sglang.parse_response(aborted, SUP)
    selected = copy.deepcopy(SUP)
    selected["sampling_logprobs_mode"] = "selected"
    with pytest.raises(RecordError, match="sampling_logprobs_mode='support'"):
        sglang.parse_response(fresh(selected), selected)
    short = fresh(SUP)
    short["meta_info"]["output_token_sampling_mask"].pop()
    with pytest.raises(RecordError, match="rows for 6 tokens"):
        sglang.parse_response(short, SUP)
    logits = fresh(HEAD)
    logits["meta_info"]["output_token_logprobs"][0][0] = 3.5
    with pytest.raises(RecordError, match="not a log-probability"):
        sglang.parse_response(logits, HEAD)
    mixed = fresh(HEAD)
    mixed["meta_info"]["output_token_logprobs"][0][0] -= 0.1
    with pytest.raises(RecordError, match="differ"):
        sglang.parse_response(mixed, HEAD)
    ids = fresh(HEAD)
    ids["output_ids"][0] = (ids["output_ids"][0] + 1) % fake.V
    with pytest.raises(RecordError, match="differ from output_ids"):
        sglang.parse_response(ids, HEAD)


def test_calibration_catches_raw_logprobs_statistically():
    bodies = [sglang.build_request([i % 7, i % 5 + 1, 3], max_new_tokens=8, temperature=0.5, record="head",
                                   top_logprobs_num=3) for i in range(60)]
    g = torch.Generator().manual_seed(11)
    good = [fake.sglang_generate(b, g) for b in bodies]
    recs = sglang.parse_batch(good, bodies)
    assert len(recs) == 60
    z = check_calibration(torch.cat([r.tokens for r in recs]),
                          op.Candidates(torch.cat([r.candidates.ids for r in recs]),
                                        torch.cat([r.candidates.logprobs for r in recs]), "head"))
    assert abs(z) < 4
    raw = [fake.sglang_generate(b, g, raw_logprobs=True) for b in bodies]
    with pytest.raises(RecordError, match="miscalibrated"):
        sglang.parse_batch(raw, bodies)
    sglang.parse_batch(raw, bodies, calibration_z=None)  # the check can be switched off


# ---------------------------------------------------------------- multi-turn
def test_multi_turn_trajectory_collate_and_policy_loss():
    g = torch.Generator().manual_seed(2)
    trajs = []
    for prompt in ([1, 2, 3], [4, 5]):
        traj = Trajectory(prompt)
        for turn in range(2):
            body = sglang.build_request(traj.input_ids, max_new_tokens=4, temperature=0.9, top_p=0.85, top_k=6,
                                        record="support")
            resp = fake.sglang_generate(body, g, weight_version=str(3 + turn))
            traj.add_turn(sglang.parse_response(resp, body, vocab_size=fake.V))
            traj.add_tokens([15, 14])  # tool output, not trained
        trajs.append(traj)
    seqs, batch = collate(trajs, csr=False)
    assert isinstance(collate(trajs)[1].candidates, op.CSRCandidates)  # the adapters' support records stay CSR
    assert seqs.shape == (2, 3 + 2 * 6) and batch.tokens.shape == (16,)
    assert batch.versions.tolist() == [3] * 4 + [4] * 4 + [3] * 4 + [4] * 4
    assert bool(batch.loss_mask.all()) and batch.candidates.kind == "support"
    assert seqs[0, 7:9].tolist() == [15, 14]  # tool tokens between the turns
    # the trainer (here: the same toy model) scores each token in exactly the sampler's context
    logits = torch.stack([fake.toy_logits(seqs[r, :c].tolist()) for r, c in zip(batch.rows, batch.cols)])
    logits = logits / batch.temperature[:, None]
    ids, valid = batch.candidates.ids.clamp(min=0), batch.candidates.valid
    lp = torch.log_softmax(logits, -1).gather(1, ids).masked_fill(~valid, float("-inf"))
    renorm = lp - torch.logsumexp(lp, 1, keepdim=True)
    assert torch.allclose(renorm.masked_fill(~valid, 0), batch.candidates.logprobs.masked_fill(~valid, 0), atol=1e-5)
    out = op.policy_loss(logits, batch.tokens, batch.sampler_logprobs, torch.ones(16),
                         candidates=batch.candidates, loss_mask=batch.loss_mask,
                         correction=op.Correction(weights="mis", bounds=(0.5, 5.0), score_centering=True))
    assert torch.isfinite(out.loss) and abs(float(out.metrics["kl_k3"])) < 1e-6  # same model: no mismatch


def test_trajectory_refuses_context_drift():
    g = torch.Generator().manual_seed(0)
    traj = Trajectory([1, 2, 3])
    body = sglang.build_request(traj.input_ids, max_new_tokens=2, record="head")
    traj.add_turn(sglang.parse_response(fake.sglang_generate(body, g), body))
    traj.add_tokens([9])
    retokenised = traj.input_ids[:-1] + [8]  # e.g. a chat template re-rendered the tool turn
    body2 = sglang.build_request(retokenised, max_new_tokens=2, record="head")
    with pytest.raises(RecordError, match="context differs from the trajectory at token 5"):
        traj.add_turn(sglang.parse_response(fake.sglang_generate(body2, g), body2))
    with pytest.raises(ValueError, match="different kinds"):
        other = Trajectory([1])
        b3 = sglang.build_request(other.input_ids, max_new_tokens=2, top_p=0.9, top_k=4, record="support")
        other.add_turn(sglang.parse_response(fake.sglang_generate(b3, g), b3))
        collate([traj, other])
    strings = Trajectory([1])
    b4 = sglang.build_request(strings.input_ids, max_new_tokens=2, record="head")
    strings.add_turn(sglang.parse_response(fake.sglang_generate(b4, g, weight_version="default"), b4))
    with pytest.raises(ValueError, match="version_of"):
        collate([strings])
    assert collate([strings], version_of=lambda v: 0)[1].versions.tolist() == [0, 0]


# ---------------------------------------------------------------- malformed responses and requests
DEL = object()  # a mutation that deletes the field


def _mutated(which: str, path: tuple, value):
    """The support fixture (every field: token and top log-probs, sampling mask, weight-version spans) with one
    field of the request or the response replaced (or deleted)."""
    req, resp = load("sglang_support_request.json"), load("sglang_support_response.json")
    obj = req if which == "request" else resp
    for key in path[:-1]:
        obj = obj[key]
    if value is DEL:
        del obj[path[-1]]
    else:
        obj[path[-1]] = value
    return resp, req


M, WV, REQ, RESP = "meta_info", "weight_versions", "request", "response"
MALFORMED = [
    # (which, path, value, exception, message naming the field)
    (RESP, (M, WV, 0, "start"), DEL, RecordError,
     r"weight_versions\[0\] lacks the field 'start'"),
    (RESP, (M, WV, 1, "end"), DEL, RecordError,
     r"weight_versions\[1\] lacks the field 'end'"),
    (RESP, (M, WV, 0, "version"), DEL, RecordError,
     r"weight_versions\[0\] lacks the field 'version'"),
    (RESP, (M, WV, 0, "version"), None, RecordError,
     r"weight_versions\[0\]\.version must be a string"),
    (RESP, (M, WV, 0, "start"), "0", RecordError,
     r"weight_versions\[0\]\.start must be an integer"),
    (RESP, (M, WV, 0, "start"), -1, RecordError,
     r"weight_versions\[0\]: expected 0 <= start"),
    (RESP, (M, WV, 1, "start"), 2, RecordError,
     r"weight_versions\[1\] overlaps"),
    (RESP, (M, WV, 1), ["7", 3, 6], RecordError,
     r"weight_versions\[1\] must be a JSON object"),
    (RESP, (M, WV), "6:0-3", RecordError,
     r"weight_versions must be a list"),
    (RESP, (M, "weight_version"), ["7"], RecordError,
     r"weight_version must be a string"),
    (RESP, ("output_ids",), None, RecordError,
     r"output_ids must be a list"),
    (RESP, ("output_ids", 0), 9.0, RecordError,
     r"output_ids\[0\] must be an integer"),
    (RESP, ("output_ids", 1), -10, RecordError,
     r"output_ids\[1\] must be >= 0"),
    (RESP, (M, "output_token_logprobs"), None, RecordError,
     r"output_token_logprobs must be a list"),
    (RESP, (M, "output_token_logprobs", 0), {"logprob": -1.7}, RecordError,
     r"output_token_logprobs\[0\]: expected a \[logprob"),
    (RESP, (M, "output_token_logprobs", 0, 0), "-1.7", RecordError,
     r"output_token_logprobs\[0\] log-probability must be a number"),
    (RESP, (M, "output_token_logprobs", 2, 1), True, RecordError,
     r"output_token_logprobs\[2\] token id must be an integer"),
    (RESP, (M, "output_top_logprobs"), 3.5, RecordError,
     r"output_top_logprobs must be a list"),
    (RESP, (M, "output_top_logprobs", 0, 1, 1), 13.5, RecordError,
     r"output_top_logprobs\[0\]\[1\] token id must be an integer"),
    (RESP, (M, "output_token_sampling_mask"), 3.5, RecordError,
     r"output_token_sampling_mask must be a list"),
    (RESP, (M, "output_token_sampling_mask", 0), "9 13 12", RecordError,
     r"output_token_sampling_mask\[0\] must be a list"),
    (RESP, (M, "output_token_sampling_mask", 1, 0), -1, RecordError,
     r"output_token_sampling_mask\[1\]\[0\] must be >= 0"),
    (RESP, (M, "output_token_sampling_mask", 1, 2), 14.0, RecordError,
     r"output_token_sampling_mask\[1\]\[2\] must be an integer"),
    (RESP, (M, "output_token_sampling_logprobs"), {}, RecordError,
     r"output_token_sampling_logprobs must be a list"),
    (RESP, (M, "output_token_sampling_logprobs", 0), "-1.6", RecordError,
     r"output_token_sampling_logprobs\[0\] must be a list"),
    (RESP, (M, "output_token_sampling_logprobs", 0, 1), None, RecordError,
     r"output_token_sampling_logprobs\[0\]\[1\] must be a number"),
    (REQ, ("sampling_params",), [0.7, 0.9, 8], TypeError,
     r"request sampling_params must be a JSON object"),
    (REQ, ("sampling_params", "temperature"), None, TypeError,
     r"sampling_params\.temperature must be a number"),
    (REQ, ("sampling_params", "temperature"), True, TypeError,
     r"sampling_params\.temperature must be a number"),
    (REQ, ("sampling_params", "top_p"), "0.9", TypeError,
     r"sampling_params\.top_p must be a number"),
    (REQ, ("sampling_params", "top_p"), 1.5, ValueError,
     r"sampling_params\.top_p must be in \(0, 1\]"),
    (REQ, ("sampling_params", "top_k"), {"k": 8}, TypeError,
     r"top_k must be an integer"),
    (REQ, ("input_ids",), "2 7 1 8", TypeError,
     r"request input_ids must be a list"),
    (REQ, ("input_ids", 1), None, TypeError,
     r"request input_ids\[1\] must be an integer"),
]


@pytest.mark.parametrize("which,path,value,error,match", MALFORMED,
                         ids=[f"{w}:{'.'.join(map(str, p))}={'DEL' if v is DEL else v!r}"
                              for w, p, v, _, _ in MALFORMED])
def test_malformed_field_raises_an_error_naming_it(which, path, value, error, match):
    resp, req = _mutated(which, path, value)
    with pytest.raises(error, match=match):
        sglang.parse_response(resp, req, vocab_size=fake.V)


def test_malformed_top_level_objects():
    req, resp = load("sglang_support_request.json"), load("sglang_support_response.json")
    with pytest.raises(RecordError, match="response must be a JSON object"):
        sglang.parse_response([resp], req)
    with pytest.raises(TypeError, match="request must be a JSON object"):
        sglang.parse_response(resp, None)
    with pytest.raises(RecordError, match="no meta_info"):
        sglang.parse_response({"output_ids": resp["output_ids"]}, req)


def _field_paths(obj, prefix=()):
    """Every key / index path of a JSON value (lists: their first two elements)."""
    yield prefix
    items = obj.items() if isinstance(obj, dict) else enumerate(obj[:2]) if isinstance(obj, list) else ()
    for key, value in items:
        yield from _field_paths(value, prefix + (key,))


BAD_VALUES = [DEL, None, "x", 3.5, True, -1, {}, {"a": 1}, [], [None], ["a"], [1.5], [[]]]


@pytest.mark.parametrize("which", ["request", "response"])
def test_every_malformed_field_gives_a_clear_error_or_a_valid_record(which):
    """Each field of the support fixture (head and support parts), replaced by each bad value: the parser either
    returns a record that passes the record checks, or raises RecordError (a malformed response) or
    TypeError / ValueError (a malformed request): never a KeyError, AttributeError or IndexError."""
    req, resp = load("sglang_support_request.json"), load("sglang_support_response.json")
    allowed = (RecordError,) if which == "response" else (TypeError, ValueError)
    outcomes = {"error": 0, "record": 0}
    for path in list(_field_paths(req if which == "request" else resp))[1:]:
        for value in BAD_VALUES:
            r_resp, r_req = _mutated(which, path, value)
            try:
                rec = sglang.parse_response(r_resp, r_req, vocab_size=fake.V)
            except allowed:
                outcomes["error"] += 1
                continue
            except Exception as err:  # noqa: BLE001 - any other type is the failure this test looks for
                pytest.fail(f"{which} {path} = {value!r}: {type(err).__name__}: {err}")
            if rec.candidates is not None:
                rec.candidates.validate(fake.V, len(rec), rec.tokens)
            outcomes["record"] += 1
    assert outcomes["error"] > 50 and outcomes["record"] > 0, outcomes


# ---------------------------------------------------------------- engine conventions for "off" (issue 29, class 2)
def test_top_k_all_sentinel_is_sglangs_own_default():
    """SGLang's ``SamplingParams`` defaults to ``top_k = TOP_K_ALL = 1 << 30`` and rewrites ``-1`` to it; its
    ``verify`` refuses ``top_k = 0`` (0 is *not* "off" in SGLang, unlike vLLM)."""
    mod = pytest.importorskip("sglang.srt.sampling.sampling_params")
    assert sglang.TOP_K_ALL == mod.TOP_K_ALL == mod.SamplingParams().top_k and mod.SamplingParams().top_p == 1.0
    assert mod.SamplingParams(top_k=-1).top_k == mod.TOP_K_ALL
    with pytest.raises(ValueError, match="top_k"):
        mod.SamplingParams(top_k=0).verify(1000)
    with pytest.raises(ValueError, match="top_k must be None, -1 or an integer >= 1"):
        sglang.build_request([1], max_new_tokens=2, top_k=0, record="head")


@pytest.mark.parametrize("off", [None, -1, sglang.TOP_K_ALL])
def test_top_k_off_conventions(off):
    """``top_k`` absent, ``-1`` or ``TOP_K_ALL`` is the unfiltered sampler: a head request (no ``top_k`` field
    sent), and a head response whose request states that value parses as a head record with the filter off;
    a support request needs a real filter."""
    body = sglang.build_request([1, 2], max_new_tokens=2, top_k=off, record="head")
    assert "top_k" not in body["sampling_params"] and body["sampling_params"]["top_p"] == 1.0
    with pytest.raises(ValueError, match="needs top_p < 1 or a top_k"):
        sglang.build_request([1], max_new_tokens=2, top_k=off, record="support")
    req, resp = load("sglang_head_request.json"), load("sglang_head_response.json")
    if off is not None:
        req["sampling_params"]["top_k"] = off
    rec = sglang.parse_response(resp, req, vocab_size=fake.V)
    assert rec.kind == "head" and rec.top_k is None and rec.top_p == 1.0
    for filtered in ({"top_k": 4}, {"top_p": 0.999}):
        bad = copy.deepcopy(load("sglang_head_request.json"))
        bad["sampling_params"].update(filtered)
        with pytest.raises(RecordError, match="recorded no sampling support"):
            sglang.parse_response(resp, bad, vocab_size=fake.V)


def test_sampling_mask_needs_a_finite_top_k():
    """``return_sampling_mask`` with the all-tokens sentinel (or ``-1``, or no ``top_k``: SGLang's default) is
    refused before it reaches the server."""
    pytest.importorskip("sglang.srt.sampling.sampling_params")
    for off in (sglang.TOP_K_ALL, -1, None):
        body = sglang.build_request([1], max_new_tokens=3, top_p=0.9, top_k=5, record="support")
        if off is None:
            del body["sampling_params"]["top_k"]
        else:
            body["sampling_params"]["top_k"] = off
        with pytest.raises(ValueError, match="finite top_k"):
            sglang.validate_request(body, vocab_size=1000)


def test_head_record_is_the_returned_top_k_and_the_sampled_token_is_separate():
    """SGLang returns the sampled token in ``output_token_logprobs`` and the top-K by value in
    ``output_top_logprobs``: the head record is exactly the latter (token 0's sampled id 4 at -3.46 is not in its
    head; token 1's sampled id 4 is, at rank 2), and ``lq`` is the former."""
    req, resp = load("sglang_head_request.json"), load("sglang_head_response.json")
    rec = sglang.parse_response(resp, req, vocab_size=fake.V)
    meta = resp["meta_info"]
    assert rec.sampler_logprobs.tolist() == pytest.approx([e[0] for e in meta["output_token_logprobs"]], abs=1e-7)
    assert rec.candidates.ids.tolist() == [[e[1] for e in row] for row in meta["output_top_logprobs"]]
    assert rec.candidates.ids[0].tolist() == [2, 0, 6, 13] and rec.tokens[0] == 4
    assert rec.candidates.ids[1].tolist() == [15, 4, 0, 13] and rec.tokens[1] == 4
