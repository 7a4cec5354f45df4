"""CSR support records from the adapters to the loss (docs/spec.md#record-memory): slime's
``rollout_top_p_token_ids/_offsets`` reach the loss unpadded, ``collate`` gives a TokenBatch with a
``CSRCandidates`` record, and the Megatron loss takes one in any logits layout; each equals the padded path."""

from __future__ import annotations

import pytest
import torch

import offpolicy as op
from offpolicy.adapters import Trajectory, collate, sglang, slime
from offpolicy.adapters.megatron import make_loss_func
from support.engine_fixtures import fake
from test_slime import make_case


def _slime_padded_loss(args, batch, logits):
    """The same micro-batch through the Megatron loss with the padded record (slime's path under TP)."""
    mb, kind = slime.megatron_batch(args, batch, logits.shape[1], logits.device)
    assert "candidates" not in mb and mb["candidate_ids"].dim() == 3
    corr = slime.correction_from_args(args)
    if corr.ppo_clip is None:
        mb.pop("proximal_logprobs")
    loss_func = make_loss_func(mb, correction=corr, candidate_kind=kind,
                               aggregation="seq_mean_token_mean", temperature=args.rollout_temperature,
                               logits_layout="bsv", use_parallel_state=False, reduce_metrics=False)
    return loss_func(logits)[0]


@pytest.mark.parametrize("sc", [False, True])
def test_slime_support_goes_to_the_loss_unpadded(sc, monkeypatch):
    args, batch, logits, _ = make_case(3)
    args.offpolicy_correction = {"weights": "mis", "bounds": [0.5, 5.0], "score_centering": sc}
    seen = []
    real = op.policy_loss
    monkeypatch.setattr("offpolicy.adapters.megatron.policy_loss",
                        lambda *a, **kw: seen.append(kw["candidates"]) or real(*a, **kw))
    leaf = logits.float()[None].requires_grad_(True)
    loss, metrics = slime.policy_loss(args, batch, leaf)
    loss.backward()
    assert isinstance(seen[0], op.CSRCandidates)
    # Each trained row holds exactly its recorded support: nnz = the ids slime shipped.
    assert seen[0].nnz == sum(int(x.numel()) for x in batch["rollout_top_p_token_ids"])
    leaf2 = logits.float()[None].requires_grad_(True)
    loss2 = _slime_padded_loss(args, batch, leaf2)
    loss2.backward()
    assert abs(loss.item() - loss2.item()) <= 1e-6 * max(1.0, abs(loss2.item()))
    torch.testing.assert_close(leaf.grad, leaf2.grad, rtol=1e-5, atol=1e-7)


def test_slime_csr_rows_follow_context_parallel_chunks():
    """Under CP a rank holds two zigzag chunks: the CSR record's rows land at those local rows."""
    args, batch, logits, _ = make_case(4)
    t = logits.shape[0]
    for cp_rank in (0, 1):
        mb, _ = slime.megatron_batch(args, batch, t, logits.device, cp_size=2, cp_rank=cp_rank, csr=True)
        pad, _ = slime.megatron_batch(args, batch, t, logits.device, cp_size=2, cp_rank=cp_rank)
        rec = mb["candidates"]
        back = op.CSRCandidates.from_padded(op.Candidates(pad["candidate_ids"][0], pad["candidate_logprobs"][0],
                                                          "support"))
        assert rec.num_rows == t
        assert torch.equal(rec.offsets, back.offsets) and torch.equal(rec.ids, back.ids)
        assert torch.equal(rec.logprobs, back.logprobs)


@pytest.mark.parametrize("layout", ["bsv", "sbv"])
def test_megatron_loss_takes_a_csr_record_in_any_layout(layout):
    b, s, v = 2, 5, 30
    gen = torch.Generator().manual_seed(7)
    z = torch.randn(b, s, v, generator=gen, dtype=torch.float64)
    sizes = torch.randint(1, 9, (b * s,), generator=gen)
    ids, lqs, y = [], [], torch.empty(b * s, dtype=torch.int64)
    for t, k in enumerate(sizes.tolist()):
        sup = torch.randperm(v, generator=gen)[:k]
        y[t] = sup[0]
        ids.append(sup)
        lqs.append(torch.log_softmax(torch.randn(k, generator=gen, dtype=torch.float64), 0))
    rec = op.CSRCandidates(torch.cat(ids), torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)]),
                           torch.cat(lqs).float(), "support")
    lq = torch.stack([lqs[t][0] for t in range(b * s)]).float()
    mb = {"labels": y.view(b, s), "sampler_logprobs": lq.view(b, s), "advantages": torch.randn(b, s, generator=gen),
          "loss_mask": torch.ones(b, s, dtype=torch.bool)}
    pad = rec.to_padded()
    corr = op.Correction(weights="mis", score_centering=True)
    grads = []
    for extra, batch in (({"csr_candidates": rec}, mb),
                         ({"candidate_kind": "support"},
                          {**mb, "candidate_ids": pad.ids.view(b, s, -1), "candidate_logprobs": pad.logprobs.view(b, s, -1)})):
        x = (z if layout == "bsv" else z.transpose(0, 1)).contiguous().requires_grad_(True)
        loss = make_loss_func(batch, correction=corr, logits_layout=layout, use_parallel_state=False,
                              reduce_metrics=False, **extra)(x)[0]
        loss.backward()
        grads.append((loss.detach(), x.grad))
    assert abs(float(grads[0][0] - grads[1][0])) <= 1e-12
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-11, atol=1e-13)
    with pytest.raises(ValueError, match="csr_candidates must hold b \\* s = 10 rows"):
        make_loss_func(mb, csr_candidates=rec.take_rows(torch.arange(4)), use_parallel_state=False)
    with pytest.raises(ValueError, match="pass the record once"):
        make_loss_func({**mb, "candidate_ids": pad.ids.view(b, s, -1), "candidate_logprobs": pad.logprobs.view(b, s, -1)},
                       csr_candidates=rec, use_parallel_state=False)


def test_collate_csr_multi_turn_equals_padded():
    g = torch.Generator().manual_seed(2)
    trajs = []
    for prompt in ([1, 2, 3], [4, 5]):
        traj = Trajectory(prompt)
        for turn in range(2):
            body = sglang.build_request(traj.input_ids, max_new_tokens=4, temperature=0.9, top_p=0.85, top_k=6,
                                        record="support")
            traj.add_turn(sglang.parse_response(fake.sglang_generate(body, g, weight_version=str(3 + turn)), body,
                                                vocab_size=fake.V))
            traj.add_tokens([15, 14])
        trajs.append(traj)
    seqs, padded = collate(trajs, csr=False)
    seqs_c, batch = collate(trajs)
    assert torch.equal(seqs, seqs_c) and isinstance(batch.candidates, op.CSRCandidates)
    want = op.CSRCandidates.from_padded(padded.candidates)
    assert torch.equal(batch.candidates.ids, want.ids) and torch.equal(batch.candidates.offsets, want.offsets)
    assert batch.candidates.nnz == int(padded.candidates.valid.sum()) < padded.candidates.ids.numel()
    logits = torch.stack([fake.toy_logits(seqs[r, :c].tolist()) for r, c in zip(batch.rows, batch.cols)])
    logits = logits / batch.temperature[:, None]
    corr = op.Correction(weights="mis", bounds=(0.5, 5.0), score_centering=True)
    adv = torch.randn(batch.tokens.shape[0], generator=g)
    outs = [op.policy_loss(logits, b.tokens, b.sampler_logprobs, adv, candidates=b.candidates, loss_mask=b.loss_mask,
                           correction=corr) for b in (batch, padded)]
    assert abs(float(outs[0].loss) - float(outs[1].loss)) <= 1e-6


def test_trl_records_reach_the_loss_as_one_csr_record():
    pytest.importorskip("trl")
    from types import SimpleNamespace

    from offpolicy.adapters.trl import CANDIDATES_KEY, OffPolicyGRPOTrainer

    third = torch.tensor(-1.0986)
    recs = [op.CSRCandidates(torch.tensor([3, 5, 7]), torch.tensor([0, 2, 3]), third.expand(3), "support"),
            op.CSRCandidates(torch.tensor([1, 2, 4]), torch.tensor([0, 3]), third.expand(3), "support")]
    inputs = {"completion_ids": torch.tensor([[3, 7], [2, 0]]), "completion_mask": torch.tensor([[1, 1], [1, 0]]),
              CANDIDATES_KEY: recs}
    flat = OffPolicyGRPOTrainer._flat_inputs(SimpleNamespace(offpolicy_record="support"), inputs)
    rec = flat["candidates"]
    assert isinstance(rec, op.CSRCandidates) and rec.kind == "support"
    # the second completion has one token: its second position is an empty row
    assert rec.ids.tolist() == [3, 5, 7, 1, 2, 4] and rec.offsets.tolist() == [0, 2, 3, 6, 6]
    with pytest.raises(RuntimeError, match="do not match the micro-batch's \\[2, 1\\] completions"):
        OffPolicyGRPOTrainer._flat_inputs(SimpleNamespace(offpolicy_record="support"),
                                          {**inputs, "completion_ids": inputs["completion_ids"][:, :1],
                                           "completion_mask": inputs["completion_mask"][:, :1]})


def test_reference_sampler_flattens_to_csr():
    from offpolicy.fleet.sampler import sample

    class _LM(torch.nn.Module):
        def forward(self, input_ids):
            gen = torch.Generator().manual_seed(int(input_ids.sum()))
            return torch.randn(*input_ids.shape, 40, generator=gen)

    r = sample(_LM(), [[1, 2]] * 6, 4, temperature=0.8, top_p=0.7, record="support",
               generator=torch.Generator().manual_seed(3))
    padded, csr = r.flatten(), r.flatten(csr=True)
    assert isinstance(csr.candidates, op.CSRCandidates)
    assert csr.candidates.nnz == int(padded.candidates.valid.sum())
    csr.candidates.validate(40, csr.tokens.shape[0], csr.tokens)
    back = csr.candidates.to_padded(width=padded.candidates.width)
    assert torch.equal(back.ids, padded.candidates.ids.masked_fill(~padded.candidates.valid, -1))


def test_trl_proximal_logprobs_on_a_csr_record_equal_the_float64_ones():
    """The proximal log-probs at generation read the CSR record: support-normalised for a support record, over
    the vocabulary for a head record, 0 on untrained tokens; against a float64 recompute."""
    pytest.importorskip("trl")
    from types import SimpleNamespace

    from offpolicy.adapters.trl import OffPolicyGRPOTrainer

    gen = torch.Generator().manual_seed(9)
    n, d, v = 6, 8, 20
    hidden, head = torch.randn(n, d, generator=gen), torch.nn.Linear(d, v, bias=False)
    ids = torch.full((n, 4), -1)
    for t, k in enumerate([1, 4, 2, 3, 1, 2]):
        ids[t, :k] = torch.randperm(v, generator=gen)[:k]
    tokens = ids[:, 0].clone()
    mask = torch.tensor([True, True, False, True, True, True])
    z = (hidden.double() @ head.weight.detach().double().T) / 0.7
    for kind in ("support", "head"):
        rec = op.CSRCandidates.from_padded(op.Candidates(ids, torch.where(ids >= 0, -3.5, float("-inf")), kind))
        me = SimpleNamespace(temperature=0.7, offpolicy_record=kind)
        got = OffPolicyGRPOTrainer._sampled_logprobs(me, hidden, head, {"candidates": rec, "loss_mask": mask,
                                                                        "tokens": tokens})
        inside = torch.zeros(n, v + 1, dtype=torch.bool).scatter(1, torch.where(ids >= 0, ids, v), True)[:, :v]
        zz = z.masked_fill(~inside, float("-inf")) if kind == "support" else z
        want = torch.log_softmax(zz, -1).gather(1, tokens[:, None])[:, 0]
        torch.testing.assert_close(got.double(), torch.where(mask, want, torch.zeros_like(want)), rtol=1e-6,
                                   atol=1e-6)
        assert float(got[2]) == 0.0
