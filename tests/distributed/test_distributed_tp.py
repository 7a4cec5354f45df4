"""Vocabulary parallelism (``tp_group=``, ``vocab_start=``) on 2 and 4 gloo processes.

Each rank holds ``logits[:, start:end]`` of one batch; its loss, its per-token loss, its metrics and its gradient
shard must equal the single-process ``policy_loss`` on the whole vocabulary, and the float64 reference, for every
mode: weights none/tis/mis/reject, score centering on/off, head/support/no records, sequence and geometric weights,
OPSM, veto and KL rejections, decoupled PPO, batch normalisation, every aggregation, per-token temperatures,
uneven shards, padded vocabularies, bf16/fp32 logits. Plus the classic trap (a manual gather and a non-autograd
all-reduce give wrong gradients) and the validation of ids against the global vocabulary.

One spawn per world size runs every case (shared with ``test_distributed_cp_dp``); a pytest test per case reports
it.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

import offpolicy as op
from support.distributed_data import close, loss_kwargs, make_batch, reference, shard_bounds, single_process
from support.distributed_harness import suite_verdict

# float64 logits: the shards' partial sums are added in another order than the single pass, so agreement is to a
# few ulps of the largest term (the loss is O(1), the gradient entries O(1/N)); 1e-10 leaves 3 decades of margin.
F64 = dict(rtol=1e-9, atol=1e-10)
# The float64 oracle against the float64 fast path: the same math in another order, equally tight.
REF = dict(rtol=1e-8, atol=1e-10)
# fp32 logits: fp32 statistics over V = 50 terms per shard, rounding ~1e-7 relative per step.
F32 = dict(rtol=2e-5, atol=2e-6)

WEIGHT_MODES = [op.Correction(), op.Correction(weights="tis"), op.Correction(weights="mis")]
FAMILY = {
    "seq_tis": op.Correction(weights="tis", level="sequence", bounds=3.0),
    "geo_mis": op.Correction(weights="mis", level="geometric", bounds=(0.7, 1.4)),
    "geo_reject": op.Correction(weights="reject", level="geometric", bounds=(0.8, 1.25)),
    "opsm": op.Correction(weights="mis", opsm_delta=0.02),
    "veto_seqkl": op.Correction(weights="tis", veto=0.05, kl_rejection=op.KLRejection(0.3, "k3", "seq_mean")),
    "tokkl_sc": op.Correction(weights="mis", score_centering=True, kl_rejection=op.KLRejection(0.5, "k2")),
    "batchnorm_sc": op.Correction(weights="mis", score_centering=True, batch_normalize=True),
    "ppo": op.Correction(weights="tis", ppo_clip=(0.2, 0.28)),
}
AGGS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant")


def _mode_grid():
    """(name, kind, correction, aggregation, temperature) of every case."""
    grid = []
    for kind in (None, "head", "support"):
        for corr in WEIGHT_MODES:
            for sc in (False, True) if kind else (False,):  # centering needs a record (it raises without one)
                c = op.Correction(weights=corr.weights, score_centering=sc)
                grid.append((f"{kind}-{corr.weights}-sc{int(sc)}", kind, c, "token_mean", 1.0))
    for name, corr in FAMILY.items():
        for kind in ("head", "support"):
            grid.append((f"{kind}-{name}", kind, corr, "seq_mean_token_mean", 0.8))
    for agg in AGGS:
        grid.append((f"head-agg-{agg}", "head", op.Correction(weights="mis", score_centering=True), agg, "per_token"))
    return grid


GRID = _mode_grid()
DEGENERATE = ("empty", "all_masked")
TRITON = (("head", "logits"), ("support", "logits"), ("head", "linear"), ("support", "linear"))


def _tp_case(group, rank_in_group, bounds, name, kind, corr, agg, tau, dtype=torch.float64, seed=0):
    """Compare this rank's TP result with the single-process and reference results."""
    b = make_batch(seed=seed, kind=kind, temperature=tau)
    start, end = bounds[rank_in_group]
    want_loss, want_grad, want_out = single_process(b, corr, agg, dtype=dtype)
    shard = b.logits[:, start:end].to(dtype).clone().requires_grad_(True)

    out = op.policy_loss(shard, **loss_kwargs(b, corr, agg), tp_group=group, vocab_start=start)
    out.loss.backward()
    tol = F64 if dtype == torch.float64 else F32
    close(f"{name} loss", out.loss.detach(), want_loss, **tol)
    close(f"{name} token_loss", out.token_loss, want_out.token_loss, **tol)
    close(f"{name} grad shard", shard.grad, want_grad[:, start:end], **tol)
    assert set(out.metrics) == set(want_out.metrics), f"{name}: metric keys differ"
    for key, val in want_out.metrics.items():
        close(f"{name} metric {key}", out.metrics[key], val, **tol)
    if dtype == torch.float64:
        ref_loss, ref_grad = reference(b, corr, agg, **({"constant_normalizer": 17.0} if agg == "constant" else {}))
        close(f"{name} loss vs reference", out.loss.detach(), ref_loss, **REF)
        close(f"{name} grad vs reference", shard.grad, ref_grad[:, start:end], **REF)


def _padded_case(group, rank_in_group, world, how, real=50):
    """Padded vocabulary: ``real`` ids padded to 64; the padding is either ``-inf`` logits or columns left out.

    With ``world = 4`` (shards of 16) and 50 real ids the last shard holds 2 real ids and 14 padding columns;
    with 30 real ids the last shard (and with 4 ranks the last two) holds padding only: zero-width logits.
    """
    padded = 64
    b = make_batch(seed=3, v=real, kind="head")
    corr = op.Correction(weights="mis", score_centering=True)
    want_loss, want_grad, _ = single_process(b, corr, "token_mean")
    full = torch.cat([b.logits, torch.randn(b.n, padded - real, dtype=torch.float64) * 3], dim=1)
    width = padded // world
    start = rank_in_group * width
    local = full[:, start:start + width].clone()

    kw = loss_kwargs(b, corr, "token_mean")
    real_width = max(0, min(width, real - start))
    if how == "neg_inf":
        local[:, real_width:] = float("-inf")
        local.requires_grad_(True)
        out = op.policy_loss(local, **kw, tp_group=group, vocab_start=start)
    else:
        local.requires_grad_(True)
        out = op.policy_loss(local[:, :real_width], **kw, tp_group=group, vocab_start=start)
    out.loss.backward()
    close(f"padded-{how} loss", out.loss.detach(), want_loss, **F64)
    close(f"padded-{how} real grad", local.grad[:, :real_width], want_grad[:, start:start + real_width], **F64)
    assert bool((local.grad[:, real_width:] == 0).all()), "padding columns got a gradient"


def _naive_target_logprob(shard: torch.Tensor, tokens: torch.Tensor, start: int, group, how: str) -> torch.Tensor:
    """``log p(y)`` over a sharded vocabulary, written the two classic wrong ways.

    ``gather``: the sampled token's logit is fetched from its owner with a plain ``all_gather`` into fresh
    buffers, which autograd does not see: the ``e_y`` term of the gradient is lost on every shard.
    ``autograd_all_reduce``: ``torch.distributed.nn.functional.all_reduce`` is autograd-aware, and its backward
    all-reduces the upstream gradient; but every rank computes the same (replicated) loss, so each shard's
    gradient comes out multiplied by the group size.
    """
    from torch.distributed.nn.functional import all_reduce as autograd_all_reduce

    m = shard.detach().amax(dim=1, keepdim=True)
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    sum_exp = torch.exp(shard - m).sum(dim=1)
    local = tokens - start
    owned = (local >= 0) & (local < shard.shape[1])
    picked = shard.gather(1, local.clamp(0, shard.shape[1] - 1)[:, None])[:, 0] * owned
    if how == "gather":
        sum_exp = sum_exp.clone()
        dist.all_reduce(sum_exp, group=group)
        every = [torch.empty_like(picked) for _ in range(dist.get_world_size(group))]
        dist.all_gather(every, picked.detach(), group=group)
        picked = torch.stack(every).sum(0)
    else:
        sum_exp = autograd_all_reduce(sum_exp, group=group)
        picked = autograd_all_reduce(picked, group=group)
    return picked - (torch.log(sum_exp) + m[:, 0])


def _trap_case(group, rank_in_group, bounds):
    b = make_batch(seed=5, kind=None)
    start, end = bounds[rank_in_group]
    _, want_grad, _ = single_process(b, op.Correction(), "token_mean")
    want = want_grad[:, start:end]
    adv, active = b.adv.double(), b.mask
    errors = {}
    for how in ("gather", "autograd_all_reduce"):
        naive = b.logits[:, start:end].clone().requires_grad_(True)
        logp = _naive_target_logprob(naive, b.tokens, start, group, how)
        (-(adv * logp * active).sum() / active.sum()).backward()
        errors[how] = float((naive.grad - want).abs().max()) / float(want.abs().max())
    ours = b.logits[:, start:end].clone().requires_grad_(True)
    op.policy_loss(ours, **loss_kwargs(b, op.Correction(), "token_mean"), tp_group=group,
                   vocab_start=start).loss.backward()
    close("ours grad", ours.grad, want, **F64)
    for how, err in errors.items():
        assert err > 0.1, f"the naive '{how}' implementation was expected to be wrong; relative error {err:.3g}"


def _validation_case(group, rank_in_group, bounds):
    """Ids beyond the global vocabulary and shards that do not tile it raise on every rank."""
    b = make_batch(seed=6, kind="head")
    start, end = bounds[rank_in_group]
    v = bounds[-1][1]

    shard = b.logits[:, start:end].clone()
    kw = loss_kwargs(b, op.Correction(), "token_mean")
    op.policy_loss(shard, **kw, tp_group=group, vocab_start=start)  # valid: every id < V on some shard
    bad_tok = b.tokens.clone()
    bad_tok[0] = v
    with pytest.raises(ValueError, match="out of range for vocabulary size"):
        op.policy_loss(shard, **{**kw, "tokens": bad_tok}, tp_group=group, vocab_start=start)
    ids = b.cands.ids.clone()
    ids[3, 0] = v + 2
    with pytest.raises(ValueError, match="out of range for vocabulary size"):
        op.policy_loss(shard, **{**kw, "candidates": op.Candidates(ids, b.cands.logprobs, "head")},
                       tp_group=group, vocab_start=start)
    with pytest.raises(ValueError, match="do not tile"):
        op.policy_loss(shard, **kw, tp_group=group, vocab_start=0)


def _degenerate_case(group, rank_in_group, bounds, what):
    """``N = 0`` and a fully masked batch: a zero loss (not NaN) and a zero gradient on every shard."""
    b = make_batch(seed=10, kind="support")
    if what == "empty":
        b = b.rows(torch.zeros(0, dtype=torch.int64))
    else:
        b.mask = torch.zeros_like(b.mask)
    corr = op.Correction(weights="mis", level="geometric", bounds=(0.7, 1.4))
    start, end = bounds[rank_in_group]
    shard = b.logits[:, start:end].clone().requires_grad_(True)
    out = op.policy_loss(shard, **loss_kwargs(b, corr, "seq_mean_token_mean"), tp_group=group, vocab_start=start)
    out.loss.backward()
    assert float(out.loss.detach()) == 0.0 and torch.isfinite(out.loss)
    assert shard.grad is not None and bool((shard.grad == 0).all())


def _backend_case(group, rank_in_group, bounds, kind, path):
    """The Triton backend (the GPU default; here Triton's CPU interpreter) on each shard, fp32, against the
    single-process torch result: the sharded statistics and the gradient are the backend's, the combination is
    the primitive's."""
    b = make_batch(seed=12, kind=kind, temperature="per_token")
    corr = op.Correction(weights="mis", score_centering=True)
    start, end = bounds[rank_in_group]
    kw = loss_kwargs(b, corr, "token_mean")
    if path == "logits":
        want_loss, want_grad, _ = single_process(b, corr, "token_mean", dtype=torch.float32)
        shard = b.logits[:, start:end].float().clone().requires_grad_(True)
        out = op.policy_loss(shard, **kw, tp_group=group, vocab_start=start, backend="triton")
        out.loss.backward()
        close(f"triton {kind} loss", out.loss.detach(), want_loss, **F32)
        close(f"triton {kind} grad", shard.grad, want_grad[:, start:end], **F32)
        return
    gen = torch.Generator().manual_seed(13)
    h = torch.randn(b.n, 16, generator=gen)
    w = torch.randn(b.logits.shape[1], 16, generator=gen) * 0.5
    h1, w1 = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    want = op.policy_loss(hidden=h1, weight=w1, **kw, backend="torch")
    want.loss.backward()
    h2, w2 = h.clone().requires_grad_(True), w[start:end].clone().requires_grad_(True)
    out = op.policy_loss(hidden=h2, weight=w2, **kw, tp_group=group, vocab_start=start, backend="triton")
    out.loss.backward()
    h_grad = h2.grad.clone()
    dist.all_reduce(h_grad, group=group)
    close(f"triton linear {kind} loss", out.loss.detach(), want.loss.detach(), **F32)
    close(f"triton linear {kind} weight grad", w2.grad, w1.grad[start:end], **F32)
    close(f"triton linear {kind} hidden grad", h_grad, h1.grad, **F32)


def _low_precision_case(group, rank_in_group, bounds, dtype):
    """bf16 logits: TP equals the single-process bf16 result (same fp32 statistics, summed in another order)."""
    b = make_batch(seed=7, kind="support")
    corr = op.Correction(weights="mis", score_centering=True)
    start, end = bounds[rank_in_group]
    want_loss, want_grad, _ = single_process(b, corr, "token_mean", dtype=dtype)
    shard = b.logits[:, start:end].to(dtype).clone().requires_grad_(True)

    out = op.policy_loss(shard, **loss_kwargs(b, corr, "token_mean"), tp_group=group, vocab_start=start)
    out.loss.backward()
    close("bf16 loss", out.loss.detach(), want_loss, rtol=1e-5, atol=1e-6)
    # The bf16 gradient is rounded once from fp32 values that agree to ~1e-6: at most one bf16 ulp apart.
    close("bf16 grad", shard.grad.float(), want_grad[:, start:end].float(), rtol=2 ** -7, atol=1e-6)


LINEAR_MODES = {
    "none-plain": (None, op.Correction()),
    "head-mis-sc": ("head", op.Correction(weights="mis", score_centering=True)),
    "support-tis-sc": ("support", op.Correction(weights="tis", score_centering=True)),
    "head-geo": ("head", op.Correction(weights="mis", level="geometric", bounds=(0.7, 1.4))),
}


def _linear_case(group, rank_in_group, bounds, name, with_bias):
    """Fused-linear path: each rank holds rows ``[start, end)`` of the output weight (and bias).

    The weight (and bias) gradient shard equals the single-process one; the hidden gradient of each rank is its
    shard's part, and their sum over the group (what Megatron's ``copy_to_tensor_model_parallel_region``
    backward all-reduces) equals the single-process hidden gradient. Both are checked against the logits path of
    the float64 reference with ``z = h W^T + b``.
    """
    kind, corr = LINEAR_MODES[name]
    b = make_batch(seed=8, kind=kind, temperature="per_token")
    gen = torch.Generator().manual_seed(9)
    d = 12
    v = b.logits.shape[1]
    h = torch.randn(b.n, d, generator=gen, dtype=torch.float64)
    w = torch.randn(v, d, generator=gen, dtype=torch.float64) * 0.6
    bias = torch.randn(v, generator=gen, dtype=torch.float64) if with_bias else None
    agg = "seq_mean_token_mean"
    kw = loss_kwargs(b, corr, agg)
    h1, w1 = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    b1 = bias.clone().requires_grad_(True) if with_bias else None
    want = op.policy_loss(hidden=h1, weight=w1, bias=b1, **kw)
    want.loss.backward()
    start, end = bounds[rank_in_group]
    h2, w2 = h.clone().requires_grad_(True), w[start:end].clone().requires_grad_(True)
    b2 = bias[start:end].clone().requires_grad_(True) if with_bias else None
    out = op.policy_loss(hidden=h2, weight=w2, bias=b2, **kw, tp_group=group, vocab_start=start)
    out.loss.backward()
    h_grad = h2.grad.clone()
    dist.all_reduce(h_grad, group=group)
    close(f"linear {name} loss", out.loss.detach(), want.loss.detach(), **F64)
    close(f"linear {name} weight grad", w2.grad, w1.grad[start:end], **F64)
    close(f"linear {name} hidden grad (summed over TP)", h_grad, h1.grad, **F64)
    if with_bias:
        close(f"linear {name} bias grad", b2.grad, b1.grad[start:end], **F64)
    # The float64 oracle on the materialised logits.
    zb = b.logits.new_tensor(0.0)
    ref_h, ref_w = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    z = ref_h @ ref_w.T + (bias if with_bias else zb)
    from offpolicy.reference import reference_policy_loss

    ref_loss, _, _ = reference_policy_loss(z, **kw)
    ref_loss.backward()
    close(f"linear {name} loss vs reference", out.loss.detach(), ref_loss.detach(), **REF)
    close(f"linear {name} weight grad vs reference", w2.grad, ref_w.grad[start:end], **REF)
    close(f"linear {name} hidden grad vs reference", h_grad, ref_h.grad, **REF)


def _layouts(world: int) -> tuple[str, ...]:
    return ("world",) if world == 2 else ("world", "pairs")


def _grid(layout: str, world: int):
    return GRID if layout == "world" and world == 2 else GRID[::3]


def build_cases(rank: int, world: int) -> dict:
    """Every case on every group layout of this world: the whole world as one TP group, and on 4 ranks also
    two TP-2 subgroups."""
    cases = {}
    for layout in _layouts(world):
        if layout == "world":
            group, r, size = dist.group.WORLD, rank, world
            widths = {2: (26, 24), 4: (14, 13, 12, 11)}[world]
        else:  # TP = 2 subgroups {0, 1}, {2, 3} of a world of 4
            subgroups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
            group, r, size = subgroups[rank // 2], rank % 2, 2
            widths = (20, 30)
        bounds = shard_bounds(50, size, widths)
        for name, kind, corr, agg, tau in _grid(layout, world):
            cases[f"{layout}/{name}"] = functools.partial(_tp_case, group, r, bounds, name, kind, corr, agg, tau)
        if layout == "world":
            cases[f"{layout}/fp32"] = functools.partial(
                _tp_case, group, r, bounds, "fp32", "head", op.Correction(weights="tis", score_centering=True),
                "token_mean", "per_token", torch.float32)
            for how in ("neg_inf", "sliced"):
                cases[f"{layout}/padded-{how}"] = functools.partial(_padded_case, group, r, size, how)
            cases[f"{layout}/padded-empty-shard"] = functools.partial(_padded_case, group, r, size, "sliced", 30)
            cases[f"{layout}/trap"] = functools.partial(_trap_case, group, r, bounds)
            cases[f"{layout}/validation"] = functools.partial(_validation_case, group, r, bounds)
            cases[f"{layout}/bf16"] = functools.partial(_low_precision_case, group, r, bounds, torch.bfloat16)
            for what in DEGENERATE:
                cases[f"{layout}/{what}"] = functools.partial(_degenerate_case, group, r, bounds, what)
            for kind, path in TRITON if world == 2 else ():  # Triton's import and interpreter are slow on CPU
                cases[f"{layout}/triton-{path}-{kind}"] = functools.partial(_backend_case, group, r, bounds, kind,
                                                                            path)
            for i, name in enumerate(LINEAR_MODES):
                cases[f"{layout}/linear-{name}"] = functools.partial(_linear_case, group, r, bounds, name, i % 2 == 1)
    return cases


def _case_names(world: int) -> list[str]:
    names = []
    for layout in _layouts(world):
        names += [f"{layout}/{g[0]}" for g in _grid(layout, world)]
        if layout == "world":
            names += [f"{layout}/{x}" for x in ("fp32", "padded-neg_inf", "padded-sliced", "padded-empty-shard",
                                                 "trap", "validation", "bf16")]
            names += [f"{layout}/linear-{name}" for name in LINEAR_MODES]
            names += [f"{layout}/{what}" for what in DEGENERATE]
            names += [f"{layout}/triton-{path}-{kind}" for kind, path in TRITON if world == 2]
    return names


@pytest.mark.parametrize("case", _case_names(2))
def test_tp2(case):
    verdict = suite_verdict(__name__, 2, case)
    assert verdict is None, verdict


@pytest.mark.parametrize("case", _case_names(4))
def test_tp4_and_tp2_subgroups(case):
    verdict = suite_verdict(__name__, 4, case)
    assert verdict is None, verdict
