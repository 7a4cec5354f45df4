"""The vLLM and SGLang parsers build support records in CSR directly (docs/spec.md#record-memory): each token's
realised support and nothing more, never a ``[T, K_max]`` tensor. On responses whose supports range from one id
to thousands (a model that is peaked in some contexts and flat in others) the record holds exactly the sum of the
realised supports (its storage too), and its rows equal the padded record written out independently from the
response here, entry for entry; the loss on the collated CSR batch equals the padded batch's."""

from __future__ import annotations

import copy

import pytest
import torch

import offpolicy as op
from offpolicy.adapters import Trajectory, collate, sglang, vllm
from support.engine_fixtures import fake

V = 3000
SCALES = (0.02, 0.3, 1.0, 3.0, 8.0, 30.0)  # flat (supports of thousands) to peaked (one id)


def varied_logits(context: list[int]) -> torch.Tensor:
    """``[V]`` logits keyed by the context, their scale (so the top-p support) varying from token to token."""
    key = 1
    for i, t in enumerate(context):
        key = (key * 1000003 + (i + 1) * (t + 7)) % (2**31 - 1)
    return torch.randn(V, generator=torch.Generator().manual_seed(key)) * SCALES[key % len(SCALES)]


def padded_reference(rows: list[list[int]], vals: list[list[float]]) -> op.Candidates:
    """The padded ``[T, K_max]`` record of per-token rows (``-1`` / ``-inf`` padding): the layout the parsers
    built before, written out here with no code of theirs."""
    width = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), width), -1, dtype=torch.int64)
    lps = torch.full((len(rows), width), float("-inf"))
    for t, (r, v) in enumerate(zip(rows, vals)):
        ids[t, : len(r)] = torch.tensor(r, dtype=torch.int64)
        lps[t, : len(v)] = torch.tensor(v, dtype=torch.float32)
    return op.Candidates(ids, lps, "support")


def vllm_rows(resp: dict, source: str) -> tuple[list[list[int]], list[list[float]]]:
    """Each token's support from a generate response: the sampling mask's ids (in its order), or the finite
    processed log-probs sorted by value then id; their log-probs from the returned list."""
    choice = resp["choices"][0]
    rows, vals = [], []
    for t, item in enumerate(choice["logprobs"]["content"]):
        top = {int(e["token"][len("token_id:"):]): e["logprob"] for e in item["top_logprobs"]}
        if source == "mask":
            ids = list(choice["sampling_mask"][t])
        else:
            ids = [i for i, _ in sorted(((i, v) for i, v in top.items() if v > -9999.0), key=lambda kv: (-kv[1], kv[0]))]
        rows.append(ids)
        vals.append([top[i] for i in ids])
    return rows, vals


def check_csr(rec, rows: list[list[int]], vals: list[list[float]]) -> None:
    """The record is CSR, holds exactly the realised supports (storage included), equals the padded reference."""
    c = rec.candidates
    assert isinstance(c, op.CSRCandidates) and c.kind == "support"
    nnz = sum(len(r) for r in rows)
    assert c.nnz == nnz and c.num_rows == len(rows) and c.lengths.tolist() == [len(r) for r in rows]
    # 12 bytes per recorded id and 8 per row: no storage behind the record is padded
    assert c.ids.untyped_storage().nbytes() == 8 * nnz and c.logprobs.untyped_storage().nbytes() == 4 * nnz
    assert c.offsets.untyped_storage().nbytes() == 8 * (len(rows) + 1)
    want = padded_reference(rows, vals)
    got = c.to_padded(width=want.width)
    assert torch.equal(got.ids, want.ids) and torch.equal(got.logprobs, want.logprobs)
    c.validate(V, len(rec), rec.tokens)


def _vllm_case(source: str, seed: int, **kw):
    body = vllm.build_request([seed % 11, 4, 2], max_tokens=12, temperature=0.9, record="support",
                              support_source=source, max_logprobs=V, **kw)
    resp = fake.vllm_generate(body, torch.Generator().manual_seed(seed), mask=source == "mask",
                              logits_fn=varied_logits)
    return body, resp


@pytest.mark.parametrize("source", ["logprobs", "mask"])
def test_vllm_support_record_is_csr_of_the_realised_supports(source):
    """logprobs = V: every row's list holds the whole vocabulary, masked (-9999) everywhere outside the support;
    the supports range over the six scales, from one id to most of the vocabulary."""
    kw = {"top_p": 0.95} if source == "logprobs" else {"top_p": 0.95, "top_k": V - 1, "logprobs": V}
    sizes = []
    for seed in range(4):
        body, resp = _vllm_case(source, seed, **kw)
        rec = vllm.parse_generate_response(resp, body, vocab_size=V)
        rows, vals = vllm_rows(resp, source)
        check_csr(rec, rows, vals)
        sizes += [len(r) for r in rows]
    assert min(sizes) <= 2 and max(sizes) >= 1000  # the record spans supports of 1-2 ids to thousands


def test_vllm_rows_at_max_logprobs_need_the_mask_or_are_refused():
    """top_k = logprobs = 5 (the mask request's shape): no row has a -inf entry, so without the sampling mask the
    response is refused naming the field; with the mask each 5-id support is one CSR row; a top-p row cut at the
    list is refused or sampled-only."""
    body, resp = _vllm_case("logprobs", 3, top_k=5)
    body["sampling_params"]["logprobs"] = 5
    resp = fake.vllm_generate(body, torch.Generator().manual_seed(3), mask=False, logits_fn=varied_logits)
    assert all(e["logprob"] > -9999.0 for c in resp["choices"][0]["logprobs"]["content"] for e in c["top_logprobs"])
    with pytest.raises(vllm.RecordError, match="no field 'sampling_mask'"):
        vllm.parse_generate_response(resp, body, vocab_size=V)
    resp = fake.vllm_generate(body, torch.Generator().manual_seed(3), mask=True, logits_fn=varied_logits)
    rec = vllm.parse_generate_response(resp, body, vocab_size=V)
    rows, vals = vllm_rows(resp, "mask")
    assert [len(r) for r in rows] == [5] * 12
    check_csr(rec, rows, vals)
    cut = copy.deepcopy(body)
    cut["sampling_params"].update(top_p=0.95, logprobs=3)
    cut["sampling_params"].pop("top_k")
    resp = fake.vllm_generate(cut, torch.Generator().manual_seed(1), mask=False, logits_fn=varied_logits)
    with pytest.raises(vllm.RecordError, match="may extend past them"):
        vllm.parse_generate_response(resp, cut)
    assert vllm.parse_generate_response(resp, cut, incomplete_support="sampled_only").candidates is None


def test_vllm_empty_completion_gives_an_empty_csr_record():
    body = vllm.build_request([1, 2], max_tokens=0, temperature=0.9, top_p=0.9, record="support", max_logprobs=V)
    resp = fake.vllm_generate(body, torch.Generator().manual_seed(0), mask=False, logits_fn=varied_logits)
    rec = vllm.parse_generate_response(resp, body, vocab_size=V)
    assert len(rec) == 0 and isinstance(rec.candidates, op.CSRCandidates)
    assert rec.candidates.nnz == 0 and rec.candidates.offsets.tolist() == [0]


def test_vllm_offline_and_completions_records_are_csr_too():
    sp = vllm.build_sampling_params(max_tokens=10, temperature=0.8, top_p=0.9, record="support", max_logprobs=V)
    out = fake.vllm_offline(sp, [5, 6], torch.Generator().manual_seed(2), mask=False, logits_fn=varied_logits)
    rec = vllm.parse_request_output(out, sp, vocab_size=V)
    rows, vals = [], []
    for step in out.outputs[0].logprobs:
        kept = sorted(((i, e.logprob) for i, e in step.items() if e.logprob > float("-inf")),
                      key=lambda kv: (-kv[1], kv[0]))
        rows.append([i for i, _ in kept])
        vals.append([v for _, v in kept])
    check_csr(rec, rows, vals)
    req = {"prompt": [3, 1], "max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "logprobs": V,
           "return_tokens_as_token_ids": True}
    resp = fake.vllm_completions(req, torch.Generator().manual_seed(4), logits_fn=varied_logits)
    rec = vllm.parse_completion_response(resp, req, vocab_size=V)
    rows, vals = [], []
    for d in resp["choices"][0]["logprobs"]["top_logprobs"]:
        kept = sorted(((int(k[len("token_id:"):]), v) for k, v in d.items() if v > -9999.0),
                      key=lambda kv: (-kv[1], kv[0]))
        rows.append([i for i, _ in kept])
        vals.append([v for _, v in kept])
    check_csr(rec, rows, vals)


def sglang_response(body: dict, generator: torch.Generator) -> dict:
    """A ``/generate`` support response on :func:`varied_logits` with SGLang's top-p semantics (sort, keep while
    the mass before is at most ``top_p``), the support most probable first, renormalised."""
    sp = body["sampling_params"]
    ctx = list(body["input_ids"])
    k = body.get("top_logprobs_num") or 0
    out, tok_lp, top_lp, masks, mask_lp = [], [], [], [], []
    for _ in range(sp["max_new_tokens"]):
        probs = torch.softmax(varied_logits(ctx) / sp["temperature"], -1)
        srt, idx = probs.sort(descending=True, stable=True)
        keep = ((srt.cumsum(0) - srt) <= sp["top_p"]) & (torch.arange(V) < sp["top_k"])
        w = srt[keep]
        y = int(idx[keep][int(torch.multinomial(w / w.sum(), 1, generator=generator))])
        lp = torch.log(probs)
        out.append(y)
        tok_lp.append([float(lp[y]), y, None])
        v, i = torch.topk(lp, k)
        top_lp.append([[float(a), int(b), None] for a, b in zip(v, i)])
        masks.append(idx[keep].tolist())
        mask_lp.append(torch.log(w / w.sum()).tolist())
        ctx.append(y)
    meta = {"id": "r", "finish_reason": {"type": "length", "length": len(out)}, "weight_version": "3",
            "output_token_logprobs": tok_lp, "output_top_logprobs": top_lp, "output_token_sampling_mask": masks,
            "output_token_sampling_logprobs": mask_lp}
    return {"output_ids": out, "meta_info": meta}


def test_sglang_support_record_is_csr_of_the_realised_supports():
    sizes = []
    for seed in range(4):
        body = sglang.build_request([seed % 7, 3], max_new_tokens=12, temperature=0.9, top_p=0.95,
                                    record="support", top_logprobs_num=3)
        resp = sglang_response(body, torch.Generator().manual_seed(seed))
        rec = sglang.parse_response(resp, body, vocab_size=V)
        meta = resp["meta_info"]
        check_csr(rec, meta["output_token_sampling_mask"], meta["output_token_sampling_logprobs"])
        lq = [row[rows.index(y)] for y, rows, row in zip(resp["output_ids"], meta["output_token_sampling_mask"],
                                                          meta["output_token_sampling_logprobs"])]
        assert rec.sampler_logprobs.tolist() == pytest.approx(lq, abs=0.0)
        sizes += [len(m) for m in meta["output_token_sampling_mask"]]
    assert min(sizes) <= 2 and max(sizes) >= 1000
    # a support whose log-probs are full-vocabulary values (not renormalised) is still refused, on CSR
    body = sglang.build_request([1, 3], max_new_tokens=4, temperature=0.9, top_p=0.95, record="support",
                                top_logprobs_num=3)
    resp = sglang_response(body, torch.Generator().manual_seed(9))
    meta = resp["meta_info"]
    meta["output_token_sampling_logprobs"] = [[v - 0.1 for v in row] for row in meta["output_token_sampling_logprobs"]]
    with pytest.raises(sglang.RecordError, match="sums to probability"):
        sglang.parse_response(resp, body, vocab_size=V)


def test_collated_csr_batches_give_the_padded_loss():
    """vLLM and SGLang turns collate into one CSR record (the turns' rows back to back); the loss and gradient on
    it equal those on the padded batch of the same turns, with every token trained and with every token masked."""
    g = torch.Generator().manual_seed(5)
    trajs = []
    for p in range(3):
        traj = Trajectory([p, 4, 2])
        body = vllm.build_request(traj.input_ids, max_tokens=6, temperature=0.9, top_p=0.95, record="support",
                                  max_logprobs=V)
        traj.add_turn(vllm.parse_generate_response(fake.vllm_generate(body, g, mask=False, logits_fn=varied_logits),
                                                   body, vocab_size=V), version=2)
        traj.add_tokens([7])
        body = sglang.build_request(traj.input_ids, max_new_tokens=5, temperature=0.9, top_p=0.95, record="support")
        traj.add_turn(sglang.parse_response(sglang_response(body, g), body, vocab_size=V), version=2)
        trajs.append(traj)
    seqs, batch = collate(trajs)
    _, padded = collate(trajs, csr=False)
    assert isinstance(batch.candidates, op.CSRCandidates)
    assert batch.candidates.nnz == sum(t.candidates.nnz for tr in trajs for t in tr.turns)
    back = op.CSRCandidates.from_padded(padded.candidates)
    assert torch.equal(batch.candidates.ids, back.ids) and torch.equal(batch.candidates.offsets, back.offsets)
    logits = torch.stack([varied_logits(seqs[r, :c].tolist()) for r, c in zip(batch.rows, batch.cols)]).double()
    logits = (logits + 0.05 * torch.randn(logits.shape, generator=g, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn(batch.tokens.shape[0], generator=g, dtype=torch.float64)
    corr = op.Correction(weights="mis", bounds=(0.5, 5.0), score_centering=True)
    for mask in (batch.loss_mask, torch.zeros_like(batch.loss_mask)):  # everything trained, everything masked
        outs = []
        for b in (batch, padded):
            leaf = logits.detach().clone().requires_grad_(True)
            out = op.policy_loss(leaf, b.tokens, b.sampler_logprobs.double(), adv, candidates=b.candidates,
                                 loss_mask=mask, temperature=0.9, correction=corr)
            out.loss.backward()
            outs.append((out.loss.detach(), leaf.grad))
        assert abs(float(outs[0][0] - outs[1][0])) <= 1e-10
        torch.testing.assert_close(outs[0][1], outs[1][1], rtol=1e-9, atol=1e-12)
    assert float(outs[0][0]) == 0.0 and not bool(outs[0][1].any())


def test_turn_to_json_writes_csr_rows_ragged_and_reads_back():
    """diagnose's JSONL line of a CSR record holds each token's own support (no padding entries) and reads back
    into the same rows."""
    from offpolicy.diagnose import from_lines, turn_to_json

    body, resp = _vllm_case("logprobs", 1, top_p=0.95)
    rec = vllm.parse_generate_response(resp, body, vocab_size=V)
    line = turn_to_json(rec, group="g", version=0)
    c = rec.candidates
    assert [len(r) for r in line["candidates"]["ids"]] == c.lengths.tolist()
    assert [len(r) for r in line["candidates"]["logprobs"]] == c.lengths.tolist()
    back = from_lines([line]).candidates  # diagnose reads CSR
    assert torch.equal(back.ids, c.ids) and torch.equal(back.offsets, c.offsets.long())
    assert torch.equal(back.logprobs, c.logprobs)


def test_diagnose_reads_a_collated_csr_batch():
    """``from_token_batch`` keeps collate's CSR batch as CSR (never padded) and reads its padded twin into the same
    CSR rows."""
    from offpolicy.diagnose import from_token_batch

    traj = Trajectory([3, 4])
    body = vllm.build_request(traj.input_ids, max_tokens=6, temperature=0.9, top_p=0.95, record="support",
                              max_logprobs=V)
    traj.add_turn(vllm.parse_generate_response(fake.vllm_generate(body, torch.Generator().manual_seed(8), mask=False,
                                                                  logits_fn=varied_logits), body), version=1)
    seqs, batch = collate([traj])
    got = from_token_batch(batch, seqs, top_p=0.95).candidates
    twin = collate([traj], csr=False)
    want = from_token_batch(twin[1], twin[0], top_p=0.95).candidates
    assert isinstance(got, op.CSRCandidates) and isinstance(want, op.CSRCandidates)
    assert torch.equal(got.ids, want.ids) and torch.equal(got.logprobs, want.logprobs)
    assert torch.equal(got.offsets.long(), want.offsets.long())
