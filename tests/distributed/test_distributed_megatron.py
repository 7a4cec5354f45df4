"""The Megatron adapter against real megatron-core 0.16 on CPU (gloo, 4 processes): TP 2 (x DP 2 replicas),
TP 2 x CP 2, TP 2 x DP 2.

Exercised for real: ``parallel_state.initialize_model_parallel`` (TP, CP, DP groups),
``tensor_parallel.vocab_parallel_cross_entropy``, a real ``GPTModel`` (VocabParallelEmbedding, Megatron's
TransformerLayer with a ColumnParallel/RowParallel MLP, final LayerNorm, ColumnParallelLinear output layer,
``use_cpu_initialization``), its own loss path (``labels=``), ``pipeline_parallel.schedules.forward_step`` and
``backward_step`` (the per-token-loss 3-tuple contract), ``distributed.finalize_model_grads`` (the all-reduce of
the token count over DP x CP and the division of the gradients), and ``utils.get_batch_on_this_cp_rank``.

Not runnable on CPU, so stood in for: self-attention (``DotProductAttention`` asks ``torch.cuda`` for a buffer:
the model is attention-free, so context parallelism needs no attention communication), Megatron's
``DistributedDataParallel`` (CUDA grad buffers: a 20-line module that sums gradients over the DP x CP group the
way it does with ``calculate_per_token_loss``) and ``forward_backward_no_pipelining`` (it allocates its token
counter with ``device="cuda"``: the test runs the same loop of ``forward_step`` / ``backward_step`` and
``finalize_model_grads``).
"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("megatron.core")

import torch.distributed as dist  # noqa: E402

import offpolicy as op  # noqa: E402
from support.distributed_data import close  # noqa: E402
from support.distributed_harness import case_verdict, run_cases  # noqa: E402
from offpolicy.adapters.megatron import make_loss_func, packed_batch, split_for_context_parallel  # noqa: E402
from offpolicy.reference import reference_policy_loss  # noqa: E402

# Megatron's model and cross entropy run in fp32: sums of O(V) fp32 terms in another order on each side,
# relative rounding ~1e-7 per step; 2e-5 relative is two decades above it.
F32 = dict(rtol=2e-5, atol=2e-6)
# Our fp32 result against the float64 oracle: the fp32 rounding of the logits themselves dominates.
REF32 = dict(rtol=1e-4, atol=1e-5)

B, S, HIDDEN = 2, 16, 16
VOCAB_PADDED, VOCAB_REAL = 64, 60


def _megatron_model(tp: int, cp: int, seed: int = 0):
    """A real GPTModel without attention (CPU), fp32, identical weights on every rank (same seed)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    cfg = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, use_cpu_initialization=True,
        tensor_model_parallel_size=tp, context_parallel_size=cp, calculate_per_token_loss=True,
        params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
    )
    spec = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=WrappedTorchNorm, mlp_bda=get_bias_dropout_add,
        mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                            linear_fc2=RowParallelLinear)),
    ))
    torch.manual_seed(seed)
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB_PADDED, max_sequence_length=64,
                     position_embedding_type="none")
    # Scale the output layer so the policy is far from uniform (and the corrections bite).
    with torch.no_grad():
        model.output_layer.weight.mul_(8.0)
    return model, cfg


class _SumGradsOverDataParallel(torch.nn.Module):
    """Stands in for megatron's DistributedDataParallel (CUDA-only buffers): with ``calculate_per_token_loss`` it
    sums gradients over the DP x CP group (scaling factor 1), and ``finalize_model_grads`` then divides them by
    the all-reduced token count through ``scale_gradients``."""

    def __init__(self, module, group):
        super().__init__()
        from megatron.core.distributed import DistributedDataParallelConfig

        self.module, self.group = module, group
        self.ddp_config = DistributedDataParallelConfig()

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_grad_sync(self, force_all_reduce=False):
        for p in self.module.parameters():
            if p.grad is not None and dist.get_world_size(self.group) > 1:
                dist.all_reduce(p.grad, group=self.group)

    def scale_gradients(self, factor):
        for p in self.module.parameters():
            if p.grad is not None:
                p.grad.mul_(factor)

    def zero_grad_buffer(self):
        for p in self.module.parameters():
            p.grad = None


def _full_logits(model, input_ids, tp_group) -> torch.Tensor:
    """``[b, s, V_padded]`` float64 logits gathered over TP (no autograd), identical on every rank."""
    with torch.no_grad():
        local = model(input_ids, _positions(input_ids), None)
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(tp_group))]
        dist.all_gather(parts, local.contiguous(), group=tp_group)
    return torch.cat(parts, dim=-1).double()


def _positions(ids):
    return torch.arange(ids.shape[1]).expand_as(ids)


def _rl_batch(z: torch.Tensor, kind: str | None, seed: int, seq_lens=(3, 5, 2, 6, 4, 7, 5)) -> dict:
    """A packed RL micro-batch of ``[B, S]`` from real logits ``z [B, S, V_real]``: labels drawn from a sampler
    perturbed in logit space, head (top-8) or support (a top-p-like set containing the label) records in CSR."""
    gen = torch.Generator().manual_seed(seed)
    t = B * S
    zf = z.reshape(t, -1)
    q = torch.softmax(zf + 0.5 * torch.randn(zf.shape, generator=gen, dtype=torch.float64), -1)
    labels = torch.multinomial(q, 1, generator=gen)[:, 0]
    lq = torch.log(q[torch.arange(t), labels])
    ids, lps, offsets = [], [], [0]
    for i in range(t):
        if kind == "head":
            top = torch.topk(q[i], 8)
            row_ids, row_lp = top.indices, torch.log(top.values)
        elif kind == "support":
            order = torch.argsort(q[i], descending=True)
            keep = order[: int(torch.randint(1, 7, (1,), generator=gen))]
            if not bool((keep == labels[i]).any()):
                keep = torch.cat([keep, labels[i : i + 1]])
            row_ids, row_lp = keep, torch.log(q[i, keep] / q[i, keep].sum())
            lq[i] = row_lp[keep == labels[i]][0]
        else:
            row_ids, row_lp = torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.float64)
        ids.append(row_ids)
        lps.append(row_lp)
        offsets.append(offsets[-1] + row_ids.numel())
    # One packed row per batch entry: sequences of seq_lens tokens (the last sequence runs to the end).
    cu = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()])
    seq_adv = torch.randn(len(seq_lens) + 1, generator=gen, dtype=torch.float64)
    seq_adv[0] = -1.0
    rows = []
    for r in range(B):
        sl = slice(r * S, (r + 1) * S)
        cu_r = torch.cat([cu[cu < S], torch.tensor([S])]).unique()
        seq = torch.bucketize(torch.arange(S), cu_r[1:], right=True)
        adv = seq_adv[seq].float()
        mask = torch.rand(S, generator=gen) < 0.85
        csr = {}
        if kind is not None:
            off = torch.tensor(offsets[r * S : (r + 1) * S + 1])
            csr = dict(candidate_ids=torch.cat(ids[sl]), candidate_offsets=off - off[0],
                       candidate_logprobs=torch.cat(lps[sl]).float(), candidate_width=8)
        row = packed_batch(labels[sl], lq[sl].float(), adv, mask, **csr)
        row["seq_ids"] = (seq + r * 100).unsqueeze(0)  # sequence ids distinct over the batch rows
        rows.append(row)
    return {k: torch.cat([row[k] for row in rows]) for k in rows[0]}


def _flat(batch: dict, kind: str | None):
    """The batch flattened to ``policy_loss`` arguments (``[b, s]`` row order)."""
    kw = dict(tokens=batch["labels"].reshape(-1), sampler_logprobs=batch["sampler_logprobs"].reshape(-1),
              advantages=batch["advantages"].reshape(-1), loss_mask=batch["loss_mask"].reshape(-1).bool(),
              seq_ids=batch["seq_ids"].reshape(-1))
    if kind is not None:
        k = batch["candidate_ids"].shape[-1]
        kw["candidates"] = op.Candidates(batch["candidate_ids"].reshape(-1, k),
                                         batch["candidate_logprobs"].reshape(-1, k), kind)
    return kw


MODES = {
    "plain": (None, op.Correction(), "token_mean"),
    "head-none-sc": ("head", op.Correction(score_centering=True), "token_mean"),
    "head-tis": ("head", op.Correction(weights="tis"), "token_mean"),
    "head-mis-sc": ("head", op.Correction(weights="mis", score_centering=True), "token_mean"),
    "support-none": ("support", op.Correction(), "token_mean"),
    "support-tis-sc": ("support", op.Correction(weights="tis", score_centering=True), "token_mean"),
    "support-mis-sc": ("support", op.Correction(weights="mis", score_centering=True), "seq_mean_token_mean"),
    "none-mis": (None, op.Correction(weights="mis"), "token_mean"),
    "head-geo": ("head", op.Correction(weights="mis", level="geometric", bounds=(0.6, 1.6)), "seq_mean_token_mean"),
    "head-seq-tis": ("head", op.Correction(weights="tis", level="sequence", bounds=3.0), "seq_mean_token_sum"),
    "support-opsm": ("support", op.Correction(weights="mis", opsm_delta=0.01), "seq_mean_token_mean"),
}


def _ce_case(tp_group):
    """No correction, advantage 1: our TP loss and gradient equal ``vocab_parallel_cross_entropy``'s."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    gen = torch.Generator().manual_seed(3)
    tp, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    full = torch.randn(S, B, VOCAB_PADDED, generator=gen) * 4  # [s, b, V]: the output layer's layout
    labels = torch.randint(0, VOCAB_PADDED, (B, S), generator=gen)
    mask = torch.rand(B, S, generator=gen) < 0.8
    width = VOCAB_PADDED // tp
    shard_m = full[:, :, r * width:(r + 1) * width].clone().requires_grad_(True)
    ce = vocab_parallel_cross_entropy(shard_m, labels.t().contiguous())  # [s, b]
    ce_sum = (ce * mask.t()).sum()
    ce_sum.backward()
    shard_o = full[:, :, r * width:(r + 1) * width].clone().requires_grad_(True)
    batch = dict(labels=labels, sampler_logprobs=torch.full((B, S), -1.0), advantages=torch.ones(B, S),
                 loss_mask=mask)
    loss, count, report = make_loss_func(batch, logits_layout="sbv")(shard_o)
    loss.backward()
    close("loss vs vocab_parallel_cross_entropy", loss.detach(), ce_sum.detach(), **F32)
    close("grad vs vocab_parallel_cross_entropy", shard_o.grad, shard_m.grad, **F32)
    assert int(count) == int(mask.sum()) and count.dtype == torch.int
    # Reported over the DP replicas (which hold the same data here): the same mean, dp times the count.
    dp = ps.get_data_parallel_world_size()
    close("reported policy loss", report["policy loss"][0] / report["policy loss"][1], ce_sum.detach() / mask.sum(),
          **F32)
    assert float(report["policy loss"][1]) == dp * int(mask.sum())
    # Per token, through policy_loss directly.
    out = op.policy_loss(shard_o.detach().reshape(S * B, width), labels.t().reshape(-1),
                         torch.full((S * B,), -1.0), torch.ones(S * B), loss_mask=mask.t().reshape(-1),
                         tp_group=ps.get_tensor_model_parallel_group(), vocab_start=r * width)
    close("token loss vs cross entropy", out.token_loss, (ce * mask.t()).detach().reshape(-1), **F32)


def _gpt_step(model, cfg, micro_batches, loss_factory, group) -> tuple[list, torch.Tensor]:
    """Megatron's no-pipelining loop on CPU: ``forward_step`` / ``backward_step`` per micro-batch, then
    ``finalize_model_grads`` with the summed token count (as ``forward_backward_no_pipelining`` does)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel.schedules import backward_step, forward_step

    wrapped = _SumGradsOverDataParallel(model, group)
    wrapped.zero_grad_buffer()
    store: list = []
    total = torch.zeros((), dtype=torch.int)

    def forward_step_func(data_iterator, m):
        mb = next(data_iterator)
        logits = m(mb["input_ids"], _positions(mb["input_ids"]), None, labels=mb.get("megatron_labels"))
        return logits, loss_factory(mb)

    it = iter(micro_batches)
    for _ in micro_batches:
        out, n = forward_step(forward_step_func, it, wrapped, len(micro_batches), None, store, cfg,
                              cp_group_size=ps.get_context_parallel_world_size(), is_last_stage=True)
        backward_step(None, out, None, ModelType.encoder_or_decoder, cfg)
        total += n
    finalize_model_grads([wrapped], total)
    return store, total


def _pretrain_gpt_loss_func(mask):
    """Megatron's own pretrain_gpt ``loss_func`` (per-token path), for the model-level equivalence."""

    def loss_func(per_token):
        m = mask.float()
        loss = (per_token.float() * m).sum()
        n = m.sum().to(torch.int)
        return loss, n, {"lm loss": torch.stack([loss.detach(), m.sum()])}

    return loss_func


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _model_equivalence_case(model, cfg, input_ids, batch, dp_cp_group):
    """Through Megatron's schedule: no correction and advantage 1 equal Megatron's own ``labels=`` loss path."""
    ones = dict(batch, advantages=torch.ones_like(batch["advantages"]))
    ones.pop("candidate_ids", None)
    ones.pop("candidate_logprobs", None)
    mb_ours = [{"input_ids": input_ids, **ones}]
    store_o, n_o = _gpt_step(model, cfg, mb_ours, lambda mb: make_loss_func(
        {k: v for k, v in mb.items() if k != "input_ids"}, vocab_size=None), dp_cp_group)
    ours = _grads(model)
    mb_meg = [{"input_ids": input_ids, "megatron_labels": batch["labels"]}]
    store_m, n_m = _gpt_step(model, cfg, mb_meg, lambda mb: _pretrain_gpt_loss_func(batch["loss_mask"]), dp_cp_group)
    theirs = _grads(model)
    assert int(n_o) == int(n_m)
    # Ours is already reduced over DP (whose replicas hold the same data here), Megatron's lm loss is not: the
    # ratios, which Megatron-LM's train_step reports, agree.
    ours_pair, theirs_pair = store_o[0]["policy loss"], store_m[0]["lm loss"]
    close("policy loss vs lm loss", ours_pair[0] / ours_pair[1], theirs_pair[0] / theirs_pair[1], **F32)
    assert set(ours) == set(theirs) and len(ours) >= 8
    for name in ours:
        close(f"param grad {name}", ours[name], theirs[name], **F32)


def _mode_case(model, input_ids, tp_group, name, seed):
    """The adapter on the real model's logits vs single-process ``policy_loss`` and the float64 oracle."""
    kind, corr, agg = MODES[name]
    z = _full_logits(model, input_ids, tp_group)[..., :VOCAB_REAL]
    batch = _rl_batch(z, kind, seed=seed)
    with torch.no_grad():
        local = model(input_ids, _positions(input_ids), None)
    shard = local.clone().requires_grad_(True)
    r, width = dist.get_rank(tp_group), local.shape[-1]
    start, real = r * width, min(width, VOCAB_REAL - r * width)
    loss_func = make_loss_func(batch, correction=corr, candidate_kind=kind or "head", aggregation=agg,
                               vocab_size=VOCAB_REAL)
    loss, count, report = loss_func(shard)
    loss.backward()
    zs = z.float().reshape(B * S, VOCAB_REAL).clone().requires_grad_(True)
    single = op.policy_loss(zs, correction=corr, aggregation=agg, **_flat(batch, kind))
    single.loss.backward()
    per = loss.detach() / count
    close(f"{name} loss", per, single.loss.detach(), **F32)
    grad = shard.grad.reshape(B * S, width) / count
    close(f"{name} grad", grad[:, :real], zs.grad[:, start:start + real], **F32)
    assert bool((grad[:, real:] == 0).all()), "padded vocabulary columns got a gradient"
    for key in ("kl_k1", "kl_k3", "weight_mean", "entropy", "extreme_ratio_frac"):
        close(f"{name} metric {key}", report[key][0] / report[key][1], single.metrics[key], **F32)
    close(f"{name} weight_max", report["weight_max"][0], single.metrics["weight_max"], **F32)
    close(f"{name} ess", report["ess"][0], single.metrics["ess"], **F32)
    ref = reference_policy_loss(z.reshape(B * S, VOCAB_REAL), correction=corr, aggregation=agg,
                                **_flat(batch, kind))[0]
    close(f"{name} loss vs reference", per, ref, **REF32)


def _cp_split_case(cp_group):
    """``split_for_context_parallel`` (bshd) equals Megatron's ``get_batch_on_this_cp_rank`` key by key."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    z = torch.randn(B, S, VOCAB_REAL, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    batch = _rl_batch(z, "head", seed=5)
    ours = split_for_context_parallel(batch, dist.get_world_size(cp_group), dist.get_rank(cp_group))
    theirs = get_batch_on_this_cp_rank(dict(batch), cp_group=cp_group)
    assert set(ours) == set(theirs)
    for k in ours:
        assert torch.equal(ours[k], theirs[k]), k


def _config_case():
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, calculate_per_token_loss=False)
    batch = dict(labels=torch.zeros(1, 4, dtype=torch.int64), sampler_logprobs=torch.zeros(1, 4),
                 advantages=torch.zeros(1, 4), loss_mask=torch.ones(1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="calculate_per_token_loss"):
        make_loss_func(batch, config=cfg)
    with pytest.raises(ValueError, match="constant"):
        make_loss_func(batch, aggregation="constant")
    with pytest.raises(ValueError, match="unknown keys"):
        make_loss_func({**batch, "tokens": batch["labels"]})
    with pytest.raises(ValueError, match="seq_ids"):
        make_loss_func(batch, aggregation="seq_mean_token_mean")


def _split_case(model, input_ids, name, split: str):
    """CP or DP split through Megatron's schedule: parameter gradients equal the one-batch gradients.

    ``split="cp"``: each CP rank keeps its zigzag share of both rows (Megatron's ``get_batch_on_this_cp_rank``),
    two micro-batches of one row each; sequences are split over the CP ranks and their statistics all-reduced.
    ``split="dp"``: each DP rank keeps one row, in two micro-batches cut at a sequence boundary (without a CP
    group, sequence statistics are per micro-batch, so sequences must stay whole).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank

    kind, corr, agg = MODES[name]
    tp_group = ps.get_tensor_model_parallel_group()
    dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
    z = _full_logits(model, input_ids, tp_group)[..., :VOCAB_REAL]
    batch = _rl_batch(z, kind, seed=17)
    # One-batch reference: the same model, the whole batch, our normalised loss, no schedule.
    model.zero_grad(set_to_none=True)
    logits = model(input_ids, _positions(input_ids), None)
    width = logits.shape[-1]
    r = ps.get_tensor_model_parallel_rank()
    real = min(width, VOCAB_REAL - r * width)
    want = op.policy_loss(logits.reshape(B * S, width)[:, :real], correction=corr, aggregation=agg,
                          tp_group=tp_group, vocab_start=r * width, **_flat(batch, kind))
    want.loss.backward()
    want_grads = _grads(model)

    def factory(mb):
        return make_loss_func({k: v for k, v in mb.items() if k != "input_ids"}, correction=corr,
                              candidate_kind=kind or "head", aggregation=agg, vocab_size=VOCAB_REAL)

    full = {"input_ids": input_ids, **batch}
    if split == "cp":
        mine = get_batch_on_this_cp_rank(dict(full))
        micro = [{k: v[i:i + 1] for k, v in mine.items()} for i in range(B)]
    else:
        row = {k: v[ps.get_data_parallel_rank():ps.get_data_parallel_rank() + 1] for k, v in full.items()}
        cut = 8  # a sequence boundary of every row (seq_lens 3, 5 | 2, 6, ...)
        micro = [{k: v[:, :cut] for k, v in row.items()}, {k: v[:, cut:] for k, v in row.items()}]
    store, total = _gpt_step(model, model.config, micro, factory, dp_cp)
    got = _grads(model)
    for pname in want_grads:
        close(f"{split} {name} param grad {pname}", got[pname], want_grads[pname], **F32)
    loss_sum = sum(s["policy loss"][0] for s in store)
    cnt = sum(s["policy loss"][1] for s in store)
    # The report is already reduced over DP x CP: every rank holds the global sum and count.
    close(f"{split} {name} reported loss", loss_sum / cnt, want.loss.detach(), **F32)
    close(f"{split} {name} reported kl_k1", sum(s["kl_k1"][0] for s in store) / sum(s["kl_k1"][1] for s in store),
          want.metrics["kl_k1"], **F32)


def _worker(rank: int, world: int) -> dict[str, str | None]:
    """One spawn of 4 ranks, three Megatron layouts in turn: TP 2 x DP 2 (the DP replicas hold the same data,
    so every TP-2 result must come out as on one replica), TP 2 x CP 2, TP 2 x DP 2 with split data."""
    from megatron.core import parallel_state as ps

    torch.set_num_threads(1)
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    model, cfg = _megatron_model(2, 1)
    input_ids = torch.randint(0, VOCAB_REAL, (B, S), generator=torch.Generator().manual_seed(1))
    tp_group = ps.get_tensor_model_parallel_group()
    z = _full_logits(model, input_ids, tp_group)[..., :VOCAB_REAL]
    eq_batch = _rl_batch(z, None, seed=9)
    cases: dict = {
        "tp2/vocab_parallel_cross_entropy": functools.partial(_ce_case, tp_group),
        "tp2/gpt_model_equivalence": functools.partial(
            _model_equivalence_case, model, cfg, input_ids, eq_batch,
            ps.get_data_parallel_group(with_context_parallel=True)),
    }
    for i, name in enumerate(MODES):
        cases[f"tp2/mode/{name}"] = functools.partial(_mode_case, model, input_ids, tp_group, name, 100 + i)
    cases["tp2/cp_split_matches_megatron"] = functools.partial(_cp_split_case, ps.get_data_parallel_group())
    cases["tp2/config_checks"] = _config_case
    out = run_cases(cases)
    ps.destroy_model_parallel()
    for split, kwargs in (("cp", dict(context_parallel_size=2)), ("dp", {})):
        ps.initialize_model_parallel(tensor_model_parallel_size=2, **kwargs)
        model, _ = _megatron_model(2, 2 if split == "cp" else 1)
        cases = {f"tp2x{split}2/{name}": functools.partial(_split_case, model, input_ids, name, split)
                 for name in SPLIT_MODES}
        out.update(run_cases(cases))
        ps.destroy_model_parallel()
    return out


SPLIT_MODES = ("head-mis-sc", "head-geo", "support-opsm", "head-seq-tis")
TP2_CASES = (["tp2/vocab_parallel_cross_entropy", "tp2/gpt_model_equivalence"] + [f"tp2/mode/{n}" for n in MODES]
             + ["tp2/cp_split_matches_megatron", "tp2/config_checks"])
SPLIT_CASES = [f"tp2x{s}2/{n}" for s in ("cp", "dp") for n in SPLIT_MODES]


@pytest.mark.parametrize("case", TP2_CASES + SPLIT_CASES)
def test_megatron(case):
    verdict = case_verdict(_worker, 4, (), case)
    assert verdict is None, verdict
