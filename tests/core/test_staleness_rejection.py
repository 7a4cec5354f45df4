"""The staleness rejection (docs/spec.md#staleness-rejection): ``Correction(max_staleness=k)`` rejects trained tokens
whose policy version lags ``current_version`` by more than ``k``; ``StalenessRejection(k, "sequence")`` in
``rejections=`` rejects their whole sequences. Checked against the float64 reference (loss, weights, gradient, the
rule's metric) and against a transcription of Miles' group staleness bound (``--max-weight-staleness``)."""

from __future__ import annotations

import math

import pytest
import torch

import offpolicy as op
from offpolicy.corrections import StalenessRejection
from offpolicy.reference import reference_metrics
from support.agreement import assert_matches_reference


def _batch(seed: int, n_seq: int = 5, vocab: int = 11, hostile: bool = False):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 7, (n_seq,), generator=g)
    seq = torch.repeat_interleave(torch.arange(n_seq), lengths)
    n = int(lengths.sum())
    z = 2 * torch.randn(n, vocab, generator=g, dtype=torch.float64)
    y = torch.randint(0, vocab, (n,), generator=g)
    lq = torch.log_softmax(z + torch.randn(n, vocab, generator=g, dtype=torch.float64), 1)[torch.arange(n), y]
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = torch.rand(n, generator=g) < 0.85
    current = 20
    versions = current - torch.randint(0, 6, (n,), generator=g)
    versions[~mask] = current + 7  # untrained rows may hold anything (padding), even a future version
    if hostile:
        z[0, y[0]] = -math.inf
    perm = torch.randperm(n, generator=g)
    return z[perm], y[perm], lq[perm], adv[perm], seq[perm], mask[perm], versions[perm], current


CORRECTIONS = [
    op.Correction(max_staleness=0),
    op.Correction(max_staleness=2),
    op.Correction(weights="mis", max_staleness=3, veto=0.05),
    op.Correction(weights="tis", rejections=(StalenessRejection(2, "sequence"),)),
    op.Correction(weights="reject", bounds=(0.3, 3.0), max_staleness=1, rejected_in_normalizer=False),
    op.Correction(weights="tis", ppo_clip=(0.2, 0.28), max_staleness=2,
                  rejections=(StalenessRejection(4, "sequence"),)),
]


@pytest.mark.parametrize("corr", CORRECTIONS, ids=lambda c: "-".join(c.tree.rule_names) + f"-{c.surrogate.name}")
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("seed", range(4))
def test_staleness_rejection_matches_the_reference(corr, aggregation, seed):
    z, y, lq, adv, seq, mask, versions, current = _batch(seed, hostile=seed == 3)
    prox = None
    if corr.tree.surrogate.needs_proximal:
        prox = (lq + 0.1 * torch.randn(lq.shape, generator=torch.Generator().manual_seed(seed),
                                       dtype=torch.float64)).clamp(max=0.0)
    kw = dict(loss_mask=mask, correction=corr, seq_ids=seq, proximal_logprobs=prox, versions=versions,
              current_version=current)
    out = assert_matches_reference(z, y, lq, adv, aggregation=aggregation, **kw)
    ref = reference_metrics(z, y, lq, adv, **kw)
    for key in [k for k in ref if k.startswith("rejected_frac")]:
        assert math.isclose(float(out.metrics[key]), ref[key], rel_tol=1e-12, abs_tol=1e-14), key
    assert "rejected_frac/staleness" in out.metrics or "staleness" not in corr.tree.rule_names


def _miles_keep_groups(group_versions: list[list[int]], current: int, max_weight_staleness: int | None) -> list[bool]:
    """Transcribed from Miles' fully-async data buffer (``_staleness``, then the bound at retrieval): a group's
    staleness is ``current - oldest`` over its samples' weight versions, and a group is filtered iff
    ``staleness > max_weight_staleness``."""
    keep = []
    for versions in group_versions:
        staleness = current - min(versions)
        keep.append(max_weight_staleness is None or staleness <= max_weight_staleness)
    return keep


@pytest.mark.parametrize("bound", [0, 1, 2, 5])
def test_the_sequence_level_is_miles_group_bound(bound):
    """With the prompt group as the sequence, ``StalenessRejection(k, "sequence")`` keeps exactly Miles' groups:
    a group goes as soon as one of its trained tokens is more than ``k`` versions old, the boundary ``lag == k``
    kept."""
    g = torch.Generator().manual_seed(bound)
    current, n_groups = 10, 8
    lengths = torch.randint(1, 6, (n_groups,), generator=g)
    groups = torch.repeat_interleave(torch.arange(n_groups), lengths)
    n = int(lengths.sum())
    versions = current - torch.randint(0, 5, (n,), generator=g)
    versions[0] = current - bound  # the boundary itself is kept
    keep = _miles_keep_groups([versions[groups == i].tolist() for i in range(n_groups)], current, bound)
    z = torch.randn(n, 7, generator=g, dtype=torch.float64)
    y = torch.randint(0, 7, (n,), generator=g)
    lq = torch.log_softmax(z, 1)[torch.arange(n), y]
    out = op.policy_loss(z, y, lq, torch.ones(n, dtype=torch.float64), seq_ids=groups, versions=versions,
                         current_version=current,
                         correction=op.Correction(rejections=(StalenessRejection(bound, "sequence"),)))
    kept_tokens = out.token_loss != 0
    assert kept_tokens.tolist() == [keep[int(i)] for i in groups]


def test_the_token_level_drops_only_the_stale_tokens():
    z = torch.zeros(4, 3, dtype=torch.float64)
    y = torch.zeros(4, dtype=torch.long)
    lq = torch.log_softmax(z, 1)[:, 0]
    out = op.policy_loss(z, y, lq, torch.ones(4, dtype=torch.float64), versions=torch.tensor([5, 4, 3, 2]),
                         current_version=5, correction=op.Correction(max_staleness=2))
    assert (out.token_loss != 0).tolist() == [True, True, True, False]
    assert float(out.metrics["rejected_frac/staleness"]) == 0.25


@pytest.mark.parametrize("kw, match", [
    (dict(max_staleness=-1), "Correction.max_staleness must be an int >= 0"),
    (dict(max_staleness=1.5), "Correction.max_staleness must be an integer"),
    (dict(max_staleness=True), "Correction.max_staleness must be an integer"),
])
def test_bad_keywords_are_named(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        op.Correction(**kw)


def test_the_inputs_it_declares_are_required():
    z = torch.zeros(2, 3, dtype=torch.float64)
    y = torch.zeros(2, dtype=torch.long)
    lq = torch.log_softmax(z, 1)[:, 0]
    with pytest.raises(ValueError, match="StalenessRejection .Correction.max_staleness. needs the versions input"):
        op.policy_loss(z, y, lq, torch.ones(2, dtype=torch.float64), correction=op.Correction(max_staleness=1))
    with pytest.raises(ValueError, match="needs the current_version input"):
        op.policy_loss(z, y, lq, torch.ones(2, dtype=torch.float64), versions=torch.tensor([1, 1]),
                       correction=op.Correction(max_staleness=1))
    with pytest.raises(ValueError, match="level must be 'token' or 'sequence'"):
        StalenessRejection(1, "geometric")


def test_from_tree_round_trips():
    for corr in CORRECTIONS:
        assert op.Correction.from_tree(corr.tree) == corr
