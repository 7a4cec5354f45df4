"""The routing record (issue 46 item 2): construction and its checks, memory, layouts, ``take_rows`` / ``cat``
against a padded reference, ``route_flips`` and the route-agreement metrics against a pure-Python literal
computation (sets and float64 sums written out, sharing no code with the library), and the position-shift test."""

from __future__ import annotations

import random

import pytest
import torch

import offpolicy as op
from offpolicy.loss.route_metrics import route_agreement, route_flip_metrics
from offpolicy.records.routed_experts import (PAD_FILL, RoutedExperts, check_route_alignment, expert_dtype,
                                              layer_flips, route_flips, route_shift)


def _routes(t, layers, k, e, seed=0, pad=()):
    """Python lists ``[T][L][K]`` of distinct expert ids; padded tokens hold None."""
    rng = random.Random(seed)
    out = []
    for i in range(t):
        out.append(None if i in pad else [rng.sample(range(e), k) for _ in range(layers)])
    return out


def _dense(lists, layers, k, e, weights=False):
    t = len(lists)
    ids = torch.full((t, layers, k), PAD_FILL, dtype=torch.int64)
    valid = torch.tensor([r is not None for r in lists], dtype=torch.bool)
    for i, r in enumerate(lists):
        if r is not None:
            ids[i] = torch.tensor(r)
    w = None
    if weights:
        w = torch.where(valid[:, None, None], torch.rand(t, layers, k, dtype=torch.float64), 0.0).float()
    return RoutedExperts.from_ids(ids, e, valid=valid if not bool(valid.all()) else None, weights=w)


def _csr(rows_by_token, layers, e):
    """CSR record of per-token lists of per-layer id lists (any lengths); None = padded token."""
    ids, lengths = [], []
    for r in rows_by_token:
        for layer in range(layers):
            row = [] if r is None else r[layer]
            ids.extend(row)
            lengths.append(len(row))
    offsets = torch.tensor([0] + lengths).cumsum(0)
    valid = torch.tensor([r is not None for r in rows_by_token], dtype=torch.bool)
    return RoutedExperts.from_csr(torch.tensor(ids, dtype=torch.int64), offsets, e, layers,
                                  valid=None if bool(valid.all()) else valid)


def _literal_flips(a, b, layers):
    """Per token, the layers whose sets differ (none where either is padded): plain Python."""
    out = []
    for ra, rb in zip(a, b):
        if ra is None or rb is None:
            out.append([False] * layers)
            continue
        out.append([set(x) != set(y) for x, y in zip(ra, rb)])
    return out


def test_dtype_and_memory_qwen36():
    # Qwen3.6-35B-A3B: 40 MoE layers, top-8 of 256 experts -> uint8, 320 bytes per token
    assert expert_dtype(256) == torch.uint8 and expert_dtype(257) == torch.int16 and expert_dtype(8) == torch.uint8
    t = 5
    ids = torch.stack([torch.stack([torch.randperm(256)[:8] for _ in range(40)]) for _ in range(t)])
    rec = RoutedExperts.from_ids(ids, 256)
    assert rec.ids.dtype == torch.uint8 and rec.num_layers == 40 and rec.top_k == 8
    assert rec.nbytes == 320 * t and rec.bytes_per_token == 320
    wide = RoutedExperts.from_ids(ids, 512)
    assert wide.ids.dtype == torch.int16 and wide.bytes_per_token == 640
    assert torch.equal(rec.ids.long(), ids) and torch.equal(wide.ids.long(), ids)  # nothing wrapped


def test_csr_memory_and_round_trip():
    lists = _routes(7, 3, 4, 200, seed=1, pad=(2, 5))
    dense = _dense(lists, 3, 4, 200, weights=True)
    csr = dense.to_csr()
    assert csr.is_csr and csr.num_tokens == 7 and csr.ids.numel() == 5 * 3 * 4
    assert csr.nbytes == 5 * 3 * 4 * 1 + 8 * (7 * 3 + 1) + 5 * 3 * 4 * 4 + 7
    back = csr.to_dense()
    assert torch.equal(back.ids, dense.ids) and torch.equal(back.weights, dense.weights)
    assert torch.equal(back.valid, dense.valid)


def test_varying_top_k_has_no_dense_form():
    rows = [[[1, 2], [3]], [[4], [5, 6, 7]]]
    rec = _csr(rows, 2, 8)
    assert rec.lengths.tolist() == [[2, 1], [1, 3]]
    with pytest.raises(ValueError, match="RoutedExperts.offsets: the top-k varies"):
        rec.to_dense()


@pytest.mark.parametrize("seed", range(6))
def test_take_rows_and_cat_match_the_padded_reference(seed):
    g = torch.Generator().manual_seed(seed)
    lists = _routes(9, 4, 3, 64, seed=seed, pad=(1, 6))
    dense = _dense(lists, 4, 3, 64, weights=True)
    csr = dense.to_csr()
    index = torch.randint(0, 9, (12,), generator=g)
    ref_ids, ref_valid = dense.ids[index], dense.token_valid[index]
    for rec in (dense, csr):
        got = rec.take_rows(index).to_dense()
        assert torch.equal(got.ids, ref_ids) and torch.equal(got.token_valid, ref_valid)
        assert torch.equal(got.weights, dense.weights[index])
    # cat of dense and CSR pieces == the padded concatenation
    parts = [dense.take_rows(torch.arange(0, 4)), csr.take_rows(torch.arange(4, 9))]
    joined = RoutedExperts.cat(parts)
    assert joined.is_csr and torch.equal(joined.to_dense().ids, dense.ids)
    assert torch.equal(RoutedExperts.cat([dense, dense]).ids, torch.cat([dense.ids, dense.ids]))


@pytest.mark.parametrize("seed", range(8))
def test_route_flips_match_the_literal_sets(seed):
    rng = random.Random(seed)
    t, layers, k, e = 11, 5, 4, rng.choice([8, 16, 300])
    a = _routes(t, layers, k, e, seed=seed, pad=(3,))
    b = []
    for i, r in enumerate(a):
        if r is None or i == 7:
            b.append(None if i != 7 else _routes(1, layers, k, e, seed=99)[0])
            continue
        rows = []
        for row in r:
            row = list(row)
            rng.shuffle(row)                      # slot order never counts
            if rng.random() < 0.4:                # a real flip: one expert swapped for one outside the set
                row[rng.randrange(k)] = rng.choice([x for x in range(e) if x not in row])
            rows.append(row)
        b.append(rows)
    b[9] = None                                   # trainer-side padding
    want = _literal_flips(a, b, layers)
    want_counts = [sum(w) for w in want]
    sa, sb = _dense(a, layers, k, e), _dense(b, layers, k, e)
    for x, y in ((sa, sb), (sa.to_csr(), sb), (sa, sb.to_csr()), (sa.to_csr(), sb.to_csr())):
        assert layer_flips(x, y).tolist() == want
        got = route_flips(x, y)
        assert got.dtype == torch.int64 and got.tolist() == want_counts
    assert op.route_flips(sa, sa).tolist() == [0] * t


def test_route_flips_with_varying_top_k():
    a = [[[1, 2], [3]], [[4], [5, 6, 7]], None]
    b = [[[2, 1], [3, 4]], [[4], [7, 6, 5]], [[1], [2]]]
    assert route_flips(_csr(a, 2, 8), _csr(b, 2, 8)).tolist() == [1, 0, 0]


def test_route_flips_refuses_mismatched_records():
    a = _dense(_routes(4, 2, 2, 8), 2, 2, 8)
    with pytest.raises(ValueError, match="layers"):
        route_flips(a, _dense(_routes(4, 3, 2, 8), 3, 2, 8))
    with pytest.raises(ValueError, match="num_experts"):
        route_flips(a, _dense(_routes(4, 2, 2, 16), 2, 2, 16))
    with pytest.raises(ValueError, match="routed_experts: 5 token rows for 4"):
        route_flips(a, _dense(_routes(5, 2, 2, 8), 2, 2, 8))


def _literal_metrics(flips, compared, mask, groups):
    """Float64 sums written out: mean flipped layers, any-flip share, per-layer rate; overall and per group."""
    out = {}

    def put(prefix, sel):
        n = sum(sel)
        d = max(n, 1)
        out[prefix + "route_tokens"] = float(n)
        out[prefix + "route_flip_layers_mean"] = sum(sum(f) for f, s in zip(flips, sel) if s) / d
        out[prefix + "route_any_flip_frac"] = sum(1 for f, s in zip(flips, sel) if s and any(f)) / d
        for layer in range(len(flips[0])):
            out[prefix + f"route_layer_flip_frac/{layer}"] = sum(1 for f, s in zip(flips, sel) if s and f[layer]) / d

    sel = [c and m for c, m in zip(compared, mask)]
    put("", sel)
    for g in sorted({g for g, s in zip(groups, sel) if s}):
        put(f"group/{g}/", [s and gg == g for s, gg in zip(sel, groups)])
    return out


@pytest.mark.parametrize("seed", range(4))
def test_route_agreement_matches_the_literal(seed):
    rng = random.Random(seed)
    t, layers, k, e = 23, 4, 2, 16
    a = _routes(t, layers, k, e, seed=seed, pad=(0, 5))
    b = [None if r is None else [rng.sample(range(e), k) if rng.random() < 0.3 else list(row) for row in r]
         for r in a]
    mask = [rng.random() < 0.8 for _ in range(t)]
    groups = [rng.randrange(3) for _ in range(t)]
    flips = _literal_flips(a, b, layers)
    compared = [r is not None for r in a]
    want = _literal_metrics(flips, compared, mask, groups)
    got = route_agreement(_dense(a, layers, k, e), _dense(b, layers, k, e).to_csr(),
                          loss_mask=torch.tensor(mask), groups=torch.tensor(groups))
    assert set(got) == set(want)
    for key, v in want.items():
        assert got[key].dtype == torch.float64
        assert float(got[key]) == pytest.approx(v, abs=1e-12), key
    # from the per-token counts alone: the same means, no per-layer keys
    counts = route_flips(_dense(a, layers, k, e), _dense(b, layers, k, e))
    alone = route_flip_metrics(counts, torch.tensor(compared), torch.tensor(mask))
    assert float(alone["route_flip_layers_mean"]) == pytest.approx(want["route_flip_layers_mean"], abs=1e-12)
    assert not any("layer_flip" in key for key in alone)


def test_route_flip_metrics_refuses_bad_inputs():
    with pytest.raises(TypeError, match="flips"):
        route_flip_metrics(torch.rand(4))
    with pytest.raises(ValueError, match="loss_mask"):
        route_flip_metrics(torch.zeros(4, dtype=torch.int64), loss_mask=torch.ones(3, dtype=torch.bool))


def test_shift_by_one_is_named():
    lists = _routes(40, 6, 2, 32, seed=3)
    trainer = _dense(lists, 6, 2, 32)
    seq = torch.tensor([0] * 20 + [1] * 20)
    assert route_shift(trainer, trainer, seq) == 0
    # the sampler's row t holds position t + 1's routes (and row t - 1 within the sequence)
    nxt = torch.tensor([min(i + 1, 19) if i < 20 else min(i + 1, 39) for i in range(40)])
    prv = torch.tensor([max(i - 1, 0) if i < 20 else max(i - 1, 20) for i in range(40)])
    assert route_shift(trainer.take_rows(nxt), trainer, seq) == 1
    assert route_shift(trainer.take_rows(prv), trainer, seq) == -1
    with pytest.raises(ValueError, match="routed_experts: .*shifted by one position"):
        check_route_alignment(trainer.take_rows(nxt), trainer, seq)
    check_route_alignment(trainer, trainer, seq)


def test_check_aligned_names_the_off_by_one():
    rec = _dense(_routes(5, 2, 2, 8), 2, 2, 8)
    rec.check_aligned(5)
    with pytest.raises(ValueError, match="One row short"):
        rec.check_aligned(6)
    with pytest.raises(ValueError, match="One row too many"):
        rec.check_aligned(4)
    with pytest.raises(ValueError, match="routed_experts: 5 token rows for 9"):
        rec.check_aligned(9)


def test_token_batch_refuses_misaligned_routes():
    n = 4
    kw = dict(tokens=torch.zeros(n, dtype=torch.int64), sampler_logprobs=torch.zeros(n), candidates=None,
              loss_mask=torch.ones(n, dtype=torch.bool), seq_ids=torch.zeros(n, dtype=torch.int64),
              versions=torch.zeros(n, dtype=torch.int64), rows=torch.zeros(n, dtype=torch.int64),
              cols=torch.arange(1, n + 1), temperature=torch.ones(n))
    assert op.TokenBatch(**kw, routes=_dense(_routes(n, 2, 2, 8), 2, 2, 8)).routes.num_tokens == n
    with pytest.raises(ValueError, match="One row short"):
        op.TokenBatch(**kw, routes=_dense(_routes(n - 1, 2, 2, 8), 2, 2, 8))
    with pytest.raises(TypeError, match="TokenBatch.routes"):
        op.TokenBatch(**kw, routes=torch.zeros(n, 2, 2))


def test_meta_record_skips_value_checks():
    rec = RoutedExperts(torch.empty(3, 2, 2, dtype=torch.uint8, device="meta"), 8)
    assert rec.num_tokens == 3 and rec.nbytes == 12


def test_engine_sentinel_on_padded_tokens_becomes_the_fill():
    ids = torch.tensor([[[1, 2]], [[-1, -1]], [[3, 4]]])
    valid = torch.tensor([True, False, True])
    rec = RoutedExperts.from_ids(ids, 8, valid=valid)
    assert rec.ids[1].tolist() == [[PAD_FILL, PAD_FILL]] and rec.to_csr().lengths.tolist() == [[2], [0], [2]]
    with pytest.raises(ValueError, match="RoutedExperts.ids: expert id -1 is negative"):
        RoutedExperts.from_ids(ids, 8)                                   # -1 on a token declared routed
    with pytest.raises(ValueError, match="RoutedExperts.ids: padded token 1 .* stale"):
        RoutedExperts.from_ids(torch.tensor([[[1, 2]], [[5, 6]], [[3, 4]]]), 8, valid=valid)


def test_router_weights_travel_and_are_checked():
    ids = torch.tensor([[[1, 2], [3, 4]], [[5, 6], [7, 0]]])
    w = torch.tensor([[[0.6, 0.4], [0.5, 0.5]], [[0.9, 0.1], [0.7, 0.3]]], dtype=torch.bfloat16)
    rec = RoutedExperts.from_ids(ids, 8, weights=w)
    assert rec.nbytes == 8 + 16 and torch.equal(rec.to_csr().to_dense().weights, w)
    assert torch.equal(rec.take_rows(torch.tensor([1])).weights, w[1:])
    with pytest.raises(ValueError, match="RoutedExperts.weights: a negative router weight"):
        RoutedExperts.from_ids(ids, 8, weights=-w)
    with pytest.raises(ValueError, match="RoutedExperts.weights must have the shape of ids"):
        RoutedExperts.from_ids(ids, 8, weights=w[:, :1])
    with pytest.raises(ValueError, match="lacks router weights"):
        RoutedExperts.cat([rec, RoutedExperts.from_ids(ids, 8)])
