"""Context parallelism (``cp_group=``), data-parallel exactness and their combinations with vocabulary parallelism.

Context parallel: the tokens of every packed sequence are split over the ranks (Megatron's zigzag over the packed
row, Transformer Engine's per-sequence ``thd`` split, or an arbitrary assignment); each rank's loss share, summed
over the group, must equal the one-batch loss, and each rank's gradient rows the one-batch rows, for sequence and
geometric weights, OPSM, veto and sequence KL rejection, batch normalisation and every aggregation.

Data parallel: with the global ``num_loss_tokens`` / ``num_sequences``, the gradient of a shared output layer
summed over ranks and micro-batches equals the one-big-batch gradient; under ``torch.nn.parallel.
DistributedDataParallel`` (which averages) the normaliser is divided by the world size.

On 4 processes: TP 2 x CP 2 and DP 2 x TP 2.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.distributed as dist

import offpolicy as op
from support.distributed_data import Batch, close, loss_kwargs, make_batch, reference, single_process
from support.distributed_harness import suite_verdict
from offpolicy.parallel.packing import pad_cu_seqlens, scatter_to_padded, seq_ids_from_cu_seqlens, thd_cp_index, zigzag_index

# float64 throughout; sums over ranks reorder O(N) terms: 1e-10 leaves three decades of margin over rounding.
F64 = dict(rtol=1e-9, atol=1e-11)
REF = dict(rtol=1e-8, atol=1e-10)

SEQ_LENS = (5, 7, 3, 6, 4, 7)  # 32 tokens: a multiple of 2 cp for cp = 2
CP_MODES = {
    "mis-token": (op.Correction(weights="mis", score_centering=True), "token_mean"),
    "seq_tis": (op.Correction(weights="tis", level="sequence", bounds=3.0), "seq_mean_token_mean"),
    "geo_mis": (op.Correction(weights="mis", level="geometric", bounds=(0.8, 1.25)), "seq_mean_token_sum"),
    "geo_reject": (op.Correction(weights="reject", level="geometric", bounds=(0.85, 1.2)), "token_mean"),
    "opsm": (op.Correction(weights="mis", opsm_delta=0.02), "seq_mean_token_mean"),
    "veto_seqkl": (op.Correction(weights="tis", veto=0.05, kl_rejection=op.KLRejection(0.2, "k3", "seq_max")),
                   "token_mean"),
    "batchnorm": (op.Correction(weights="tis", score_centering=True, batch_normalize=True), "token_mean"),
    "seqsum_kl": (op.Correction(weights="mis", kl_rejection=op.KLRejection(1.0, "k1", "seq_sum")),
                  "seq_mean_token_sum"),
}


def _split(b: Batch, how: str, cp: int, r: int) -> tuple[Batch, torch.Tensor]:
    """This CP rank's share of the batch and the one-batch rows it holds (``-1`` for thd padding)."""
    n = b.n
    if how == "bshd":
        idx = zigzag_index(n, cp, r)
        return b.rows(idx), idx
    if how == "thd":
        cu_p = pad_cu_seqlens(b.cu_seqlens, 2 * cp)
        rows = scatter_to_padded(torch.arange(n), b.cu_seqlens, cu_p, fill=-1)
        idx = rows[thd_cp_index(cu_p, cp, r)]
        share = b.rows(idx.clamp_min(0))
        # Padding tokens: any id of their sequence, masked out of the loss.
        share.mask = share.mask & (idx >= 0)
        share.seq_ids = seq_ids_from_cu_seqlens(cu_p)[thd_cp_index(cu_p, cp, r)]
        return share, idx
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(11))
    idx = torch.sort(perm[r::cp]).values
    return b.rows(idx), idx


def _cp_case(cp_group, cp, r, tp_group, tp, tr, name, how, kind, seed=0):
    """CP share (and, with ``tp_group``, TP shard) against the one-batch single-process and reference results."""
    corr, agg = CP_MODES[name]
    if kind is None:
        corr = dataclasses.replace(corr, score_centering=False)  # centering needs a record (it raises without one)
    b = make_batch(seed=seed, kind=kind, seq_lens=SEQ_LENS, mismatch=0.4)
    want_loss, want_grad, want_out = single_process(b, corr, agg)
    ref_loss, ref_grad = reference(b, corr, agg)
    share, idx = _split(b, how, cp, r)
    v = b.logits.shape[1]
    start, end = (tr * v // tp, (tr + 1) * v // tp) if tp_group is not None else (0, v)
    z = share.logits[:, start:end].clone().requires_grad_(True)
    extra = dict(tp_group=tp_group, vocab_start=start) if tp_group is not None else {}
    out = op.policy_loss(z, **loss_kwargs(share, corr, agg), cp_group=cp_group, **extra)
    out.loss.backward()
    total = out.loss.detach().clone()
    dist.all_reduce(total, group=cp_group)
    real = idx >= 0
    close(f"{name}/{how} loss", total, want_loss, **F64)
    close(f"{name}/{how} loss vs reference", total, ref_loss, **REF)
    close(f"{name}/{how} token_loss", out.token_loss[real], want_out.token_loss[idx[real]], **F64)
    close(f"{name}/{how} weights", out.token_weight[real & share.mask], want_out.token_weight[idx[real & share.mask]],
          **F64)
    close(f"{name}/{how} grad", z.grad[real], want_grad[idx[real], start:end], **F64)
    close(f"{name}/{how} grad vs reference", z.grad[real], ref_grad[idx[real], start:end], **REF)
    assert bool((z.grad[~real] == 0).all()), "thd padding tokens got a gradient"


def _cp_sensitivity_case(cp_group, cp, r):
    """Without ``cp_group`` the geometric weights of split sequences come out wrong: the reduction matters."""
    corr, agg = CP_MODES["geo_mis"]
    b = make_batch(seed=0, kind="head", seq_lens=SEQ_LENS, mismatch=0.4)
    want = single_process(b, corr, agg)[2].token_weight
    share, idx = _split(b, "bshd", cp, r)
    with_group = op.policy_loss(share.logits, **loss_kwargs(share, corr, agg), cp_group=cp_group).token_weight
    without = op.policy_loss(share.logits, **loss_kwargs(share, corr, agg)).token_weight
    close("with cp_group", with_group, want[idx], **F64)
    assert float((without - want[idx]).abs().max()) > 1e-3, "splitting sequences should change local weights"


def _cp_empty_rank_case(cp_group, r):
    """A CP rank holding no token at all: the other rank's share is then the whole loss."""
    corr, agg = CP_MODES["geo_mis"]
    b = make_batch(seed=0, kind="head", seq_lens=SEQ_LENS, mismatch=0.4)
    want_loss, want_grad, _ = single_process(b, corr, agg)
    idx = torch.arange(b.n) if r == 0 else torch.zeros(0, dtype=torch.int64)
    share = b.rows(idx)
    z = share.logits.clone().requires_grad_(True)
    out = op.policy_loss(z, **loss_kwargs(share, corr, agg), cp_group=cp_group)
    out.loss.backward()
    total = out.loss.detach().clone()
    dist.all_reduce(total, group=cp_group)
    close("loss with an empty CP rank", total, want_loss, **F64)
    close("grad with an empty CP rank", z.grad, want_grad[idx], **F64)


def _cp_bad_ids_case(cp_group):
    """Negative sequence ids raise on every rank (after one collective, so no rank is left waiting)."""
    b = make_batch(seed=0, kind=None, seq_lens=SEQ_LENS)
    seq = b.seq_ids.clone()
    if dist.get_rank() == 0:
        seq[0] = -3
    corr, agg = CP_MODES["seq_tis"]
    with pytest.raises(ValueError, match="negative"):
        op.policy_loss(b.logits, **loss_kwargs(b, corr, agg, seq_ids=seq), cp_group=cp_group)


def _linear_params(b: Batch, d: int = 8, seed: int = 1):
    """Hidden states and an output weight whose logits ``h W^T`` stand in for the batch's logits."""
    gen = torch.Generator().manual_seed(seed)
    v = b.logits.shape[1]
    h = torch.randn(b.n, d, generator=gen, dtype=torch.float64)
    w = torch.randn(v, d, generator=gen, dtype=torch.float64) * 0.7
    return h, w


def _dp_case(dp_group, dp, r, tp_group, tp, tr, name, micro: int = 2):
    """Each DP rank runs ``micro`` micro-batches of whole sequences; summed W gradients equal the one batch's."""
    corr, agg = CP_MODES[name]
    b = make_batch(seed=2, kind="support", seq_lens=SEQ_LENS * 2, mismatch=0.4)
    h, w = _linear_params(b)
    v = w.shape[0]
    # One big batch, single process.
    w_full = w.clone().requires_grad_(True)
    big = op.policy_loss(h @ w_full.T, **loss_kwargs(b, corr, agg))
    big.loss.backward()
    n_tokens = int(b.mask.sum())
    n_seqs = int(torch.unique(b.seq_ids[b.mask]).numel())
    # Split whole sequences over dp ranks x micro-batches.
    nseq = len(SEQ_LENS) * 2
    start, end = (tr * v // tp, (tr + 1) * v // tp) if tp_group is not None else (0, v)
    w_shard = w[start:end].clone().requires_grad_(True)
    extra = dict(tp_group=tp_group, vocab_start=start) if tp_group is not None else {}
    total = torch.zeros((), dtype=torch.float64)
    for m in range(micro):
        chunk = r * micro + m
        seqs = [s for s in range(nseq) if s % (dp * micro) == chunk]
        idx = torch.nonzero(torch.isin(b.seq_ids, torch.tensor(seqs)))[:, 0]
        share = b.rows(idx)
        out = op.policy_loss(h[idx] @ w_shard.T, **loss_kwargs(share, corr, agg, num_loss_tokens=n_tokens,
                                                               num_sequences=n_seqs), **extra)
        out.loss.backward()
        total += out.loss.detach()
    grad = w_shard.grad.clone()
    dist.all_reduce(grad, group=dp_group)
    dist.all_reduce(total, group=dp_group)
    close(f"dp {name} loss", total, big.loss.detach(), **F64)
    close(f"dp {name} W grad", grad, w_full.grad[start:end], **F64)


def _ddp_case(world, r):
    """``DistributedDataParallel`` averages gradients: pass ``num_loss_tokens = global count / world``."""
    corr, agg = op.Correction(weights="mis", score_centering=True), "token_mean"
    b = make_batch(seed=4, kind="head", seq_lens=SEQ_LENS * 2, mismatch=0.4)
    h, w = _linear_params(b)
    ref_layer = torch.nn.Linear(h.shape[1], w.shape[0], bias=False, dtype=torch.float64)
    with torch.no_grad():
        ref_layer.weight.copy_(w)
    op.policy_loss(ref_layer(h), **loss_kwargs(b, corr, agg)).loss.backward()
    layer = torch.nn.Linear(h.shape[1], w.shape[0], bias=False, dtype=torch.float64)
    with torch.no_grad():
        layer.weight.copy_(w)
    ddp = torch.nn.parallel.DistributedDataParallel(layer)
    idx = torch.arange(r, b.n, world)
    share = b.rows(idx)
    n_tokens = int(b.mask.sum())
    op.policy_loss(ddp(h[idx]), **loss_kwargs(share, corr, agg, num_loss_tokens=n_tokens / world)).loss.backward()
    close("ddp W grad", layer.weight.grad, ref_layer.weight.grad, **F64)


def _fsdp_case(world, r, agg):
    """FSDP2 (``fully_shard``) averages the reduce-scattered gradients like DDP: with ``num_loss_tokens`` (or
    ``num_sequences``) divided by the world size, every parameter's gradient (gathered from its shards) is the
    one-batch gradient. The model is a two-layer MLP head whose output layer produces full-vocabulary logits."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    corr = op.Correction(weights="mis", score_centering=True) if agg == "token_mean" else op.Correction(
        weights="tis", level="geometric")
    b = make_batch(seed=6, kind="head" if agg == "token_mean" else None, seq_lens=SEQ_LENS * 2, mismatch=0.4)
    h, w = _linear_params(b)

    def model():
        torch.manual_seed(3)
        m = torch.nn.Sequential(torch.nn.Linear(h.shape[1], 16, dtype=torch.float64), torch.nn.Tanh(),
                                torch.nn.Linear(16, w.shape[0], bias=False, dtype=torch.float64))
        return m

    ref = model()
    op.policy_loss(ref(h), **loss_kwargs(b, corr, agg)).loss.backward()
    sharded = model()
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(sharded[0], mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    # Whole sequences per rank (sequence-level weights need them): sequences alternate between the ranks.
    mine = torch.nonzero(b.seq_ids % world == r)[:, 0]
    share = b.rows(mine)
    norm = {"num_loss_tokens": int(b.mask.sum()) / world} if agg == "token_mean" else {
        "num_sequences": int(torch.unique(b.seq_ids[b.mask]).numel()) / world}
    op.policy_loss(sharded(h[mine]), **loss_kwargs(share, corr, agg, **norm)).loss.backward()
    for (name, p), (_, q) in zip(sharded.named_parameters(), ref.named_parameters()):
        close(f"fsdp {agg} grad {name}", p.grad.full_tensor(), q.grad, **F64)


def build_cases(rank: int, world: int) -> dict:
    """On 2 ranks: CP 2 (the world), DP 2, DDP. On 4: TP 2 x CP 2 and DP 2 x TP 2."""
    cases = {}
    if world == 2:
        g = dist.group.WORLD
        for name in CP_MODES:
            for how, kind in SPLITS:
                cases[f"cp/{name}/{how}"] = functools.partial(_cp_case, g, 2, rank, None, 1, 0, name, how, kind)
        cases["cp/sensitivity"] = functools.partial(_cp_sensitivity_case, g, 2, rank)
        cases["cp/bad_ids"] = functools.partial(_cp_bad_ids_case, g)
        cases["cp/empty_rank"] = functools.partial(_cp_empty_rank_case, g, rank)
        for name in DP_MODES:
            cases[f"dp/{name}"] = functools.partial(_dp_case, g, 2, rank, None, 1, 0, name)
        cases["ddp"] = functools.partial(_ddp_case, world, rank)
        for agg in FSDP_AGGS:
            cases[f"fsdp/{agg}"] = functools.partial(_fsdp_case, world, rank, agg)
    else:  # TP pairs {0, 1}, {2, 3}; CP (or DP) pairs {0, 2}, {1, 3}
        tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        cross = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        tp_g, tr = tp_groups[rank // 2], rank % 2
        x_g, xr = cross[rank % 2], rank // 2
        for name in TPCP_MODES:
            cases[f"tp2xcp2/{name}"] = functools.partial(_cp_case, x_g, 2, xr, tp_g, 2, tr, name, "bshd", "head")
        cases["tp2xcp2/mis-token/thd"] = functools.partial(_cp_case, x_g, 2, xr, tp_g, 2, tr, "mis-token", "thd",
                                                           "support")
        for name in DPTP_MODES:
            cases[f"dp2xtp2/{name}"] = functools.partial(_dp_case, x_g, 2, xr, tp_g, 2, tr, name)
    return cases


SPLITS = (("bshd", "head"), ("thd", "support"), ("random", None))
DP_MODES = ("mis-token", "seq_tis", "geo_mis", "opsm", "seqsum_kl")
TPCP_MODES = ("seq_tis", "geo_mis", "opsm", "batchnorm")
DPTP_MODES = ("mis-token", "geo_mis")
FSDP_AGGS = ("token_mean", "seq_mean_token_mean")
CASES_2 = ([f"cp/{n}/{how}" for n in CP_MODES for how, _ in SPLITS] + ["cp/sensitivity", "cp/bad_ids", "cp/empty_rank"]
           + [f"dp/{n}" for n in DP_MODES] + ["ddp"] + [f"fsdp/{a}" for a in FSDP_AGGS])
CASES_4 = [f"tp2xcp2/{n}" for n in TPCP_MODES] + ["tp2xcp2/mis-token/thd"] + [f"dp2xtp2/{n}" for n in DPTP_MODES]


@pytest.mark.parametrize("case", CASES_2)
def test_cp2_dp2(case):
    verdict = suite_verdict(__name__, 2, case)
    assert verdict is None, verdict


@pytest.mark.parametrize("case", CASES_4)
def test_tp2_cp2_and_dp2_tp2(case):
    verdict = suite_verdict(__name__, 4, case)
    assert verdict is None, verdict
