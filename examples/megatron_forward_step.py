"""Megatron ``forward_step`` wiring for off-policy-corrected RL, runnable on CPU with gloo and TP = 2.

    pip install --no-deps megatron-core==0.16.1
    python examples/megatron_forward_step.py            # spawns 2 processes (TP = 2) on 127.0.0.1
    torchrun --nproc-per-node 2 examples/megatron_forward_step.py

What it shows (the part to copy is :func:`forward_step`):

1. a packed rollout batch (``cu_seqlens``, sampled tokens, the sampler's log-probabilities, its top-p support in CSR,
   GRPO advantages) turned into Megatron's ``[b, s]`` micro-batch dict with
   ``offpolicy.adapters.megatron.packed_batch``;
2. ``forward_step`` returning the vocabulary-parallel logits of ``GPTModel(..., labels=None)`` and the loss
   function of ``make_loss_func`` (MIS + score centering with top-p mask replay, padded vocabulary excluded);
3. Megatron's per-token-loss path (``calculate_per_token_loss=True``): the schedule sums the returned token
   counts, ``finalize_model_grads`` all-reduces them over data x context parallel and divides the gradients.

On a GPU cluster the model is a normal ``GPTModel`` (attention, Transformer Engine) wrapped in Megatron's
``DistributedDataParallel``, and :func:`train_step` calls ``get_forward_backward_func()``. On CPU (this example
as shipped) two things in megatron-core need CUDA: self-attention (``DotProductAttention`` takes a CUDA buffer)
and ``forward_backward_no_pipelining`` (a CUDA token counter); so the model here is attention-free (an MLP
``TransformerLayer``: the next token depends on the current one only) and the step runs Megatron's own
``forward_step`` / ``backward_step`` / ``finalize_model_grads`` in the same loop as that schedule, with a small
module summing gradients over data parallel in place of Megatron's CUDA-only DDP.

The task: sequences of tokens from a vocabulary of 60 (padded to 64 for TP); the reward is the share of tokens in
the lower half of the vocabulary. The sampler is the policy with perturbed logits (a stand-in for another
numerical precision) sampling with top-p 0.9. Rank 0 prints the reward and the mismatch metrics per step
(on a 2-core CPU: about 20 s for 6 steps, the reward going from about 0.49 to about 0.6).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

import offpolicy as op
from offpolicy.adapters.megatron import make_loss_func, packed_batch

VOCAB_REAL, VOCAB_PADDED = 60, 64  # Megatron pads the vocabulary to a multiple of 128 x TP; here of 32 x TP
HIDDEN, PROMPTS, SAMPLES, RESPONSE = 32, 4, 4, 12
TOP_P, TEMPERATURE = 0.9, 1.0
CORRECTION = op.Correction(weights="mis", bounds=(0.5, 5.0), score_centering=True)


def build_model(tp: int):
    """A GPTModel made of real Megatron tensor-parallel layers, without attention (so that it runs on CPU)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    config = TransformerConfig(
        num_layers=2, hidden_size=HIDDEN, num_attention_heads=2, use_cpu_initialization=True,
        tensor_model_parallel_size=tp, calculate_per_token_loss=True, hidden_dropout=0.0, attention_dropout=0.0,
    )
    spec = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=WrappedTorchNorm, mlp_bda=get_bias_dropout_add,
        mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                            linear_fc2=RowParallelLinear)),
    ))
    torch.manual_seed(0)  # the same weights on every rank before Megatron splits them
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB_PADDED, max_sequence_length=64,
                     position_embedding_type="none")
    return model, config


def positions(ids: torch.Tensor) -> torch.Tensor:
    return torch.arange(ids.shape[1]).expand_as(ids)


@torch.no_grad()
def rollout(model, step: int) -> tuple[dict, float]:
    """Sample ``PROMPTS x SAMPLES`` responses with a mismatched top-p sampler; return one packed micro-batch.

    The sampler sees the policy's logits (gathered over TP: a sampler holds the whole vocabulary) plus noise, and
    records for every token its realised top-p support with the renormalised log-probabilities (CSR).
    """
    from megatron.core import parallel_state as ps

    gen = torch.Generator().manual_seed(1000 + step)  # the same rollout on every rank
    tp_group = ps.get_tensor_model_parallel_group()
    n_seq = PROMPTS * SAMPLES
    seqs = torch.randint(0, VOCAB_REAL, (n_seq, 1), generator=gen)
    lq, ids, lps, counts = [], [], [], []
    for _ in range(RESPONSE):
        local = model(seqs, positions(seqs), None)[:, -1]  # [n_seq, V/tp]
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(tp_group))]
        dist.all_gather(parts, local.contiguous(), group=tp_group)
        logits = torch.cat(parts, -1)[:, :VOCAB_REAL] / TEMPERATURE
        logits = logits + 0.3 * torch.randn(logits.shape, generator=gen)  # the sampler's numerics
        p = torch.softmax(logits, -1)
        sorted_p, order = p.sort(-1, descending=True)
        keep = (sorted_p.cumsum(-1) - sorted_p) <= TOP_P
        kept = torch.where(keep, sorted_p, 0.0)
        kept = kept / kept.sum(-1, keepdim=True)
        pick = torch.multinomial(kept, 1, generator=gen)
        y = order.gather(-1, pick)
        lq.append(torch.log(kept.gather(-1, pick))[:, 0])
        for i in range(n_seq):
            k = int(keep[i].sum())
            ids.append(order[i, :k])
            lps.append(torch.log(kept[i, :k]))
            counts.append(k)
        seqs = torch.cat([seqs, y], 1)
    # Pack: each sequence contributes its RESPONSE sampled tokens; the logits at position t predict token t + 1.
    inputs = seqs[:, :-1].reshape(-1)
    labels = seqs[:, 1:].reshape(-1)
    lq_t = torch.stack(lq, 1).reshape(-1)
    order_rows = torch.arange(RESPONSE * n_seq).view(RESPONSE, n_seq).t().reshape(-1)  # step-major -> packed
    ids = [ids[j] for j in order_rows.tolist()]
    lps = [lps[j] for j in order_rows.tolist()]
    offsets = torch.tensor([0] + torch.tensor([counts[j] for j in order_rows.tolist()]).cumsum(0).tolist())
    reward = (seqs[:, 1:] < VOCAB_REAL // 2).float().mean(1)
    groups = torch.arange(n_seq) // SAMPLES
    adv = op.advantages.grpo(reward, groups)
    cu_seqlens = torch.arange(n_seq + 1) * RESPONSE
    batch = packed_batch(
        labels, lq_t.float(), op.advantages.per_token(adv, torch.arange(n_seq).repeat_interleave(RESPONSE)).float(),
        torch.ones_like(labels, dtype=torch.bool), cu_seqlens=cu_seqlens, candidate_ids=torch.cat(ids),
        candidate_offsets=offsets, candidate_logprobs=torch.cat(lps).float(),
    )
    batch["input_ids"] = inputs.unsqueeze(0)
    return batch, float(reward.mean())


def forward_step(data_iterator, model):
    """Megatron's ``forward_step_func``: vocabulary-parallel logits and the off-policy-corrected loss function."""
    from megatron.core.utils import get_model_config

    batch = dict(next(data_iterator))
    input_ids = batch.pop("input_ids")
    # labels=None: GPTModel returns the [b, s, V/tp] logits instead of its cross-entropy.
    logits = model(input_ids, positions(input_ids), None)
    # Under context parallelism the batch would first be split like any Megatron batch
    # (megatron.core.utils.get_batch_on_this_cp_rank); seq_ids travel with their tokens.
    loss_func = make_loss_func(batch, correction=CORRECTION, candidate_kind="support",
                               aggregation="seq_mean_token_mean", vocab_size=VOCAB_REAL, temperature=TEMPERATURE,
                               config=get_model_config(model))
    return logits, loss_func


class SumGradsOverDataParallel(torch.nn.Module):
    """CPU stand-in for Megatron's DistributedDataParallel (whose grad buffers are CUDA-only)."""

    def __init__(self, module):
        super().__init__()
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallelConfig

        self.module = module
        self.group = ps.get_data_parallel_group(with_context_parallel=True)
        self.ddp_config = DistributedDataParallelConfig()

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_grad_sync(self, force_all_reduce=False):
        if dist.get_world_size(self.group) > 1:
            for p in self.module.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=self.group)

    def scale_gradients(self, factor):
        for p in self.module.parameters():
            if p.grad is not None:
                p.grad.mul_(factor)


def train_step(model, config, micro_batches: list[dict]) -> list[dict]:
    """One optimizer step's forward/backward over the micro-batches; returns Megatron's ``forward_data_store``."""
    if torch.cuda.is_available():  # the cluster path (not exercised by the CPU run of this example)
        from megatron.core.pipeline_parallel import get_forward_backward_func

        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micro_batches), model=[model],
            num_microbatches=len(micro_batches), seq_length=micro_batches[0]["labels"].shape[1],
            micro_batch_size=micro_batches[0]["labels"].shape[0], forward_only=False,
        )
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel.schedules import backward_step
    from megatron.core.pipeline_parallel.schedules import forward_step as megatron_forward_step

    store: list = []
    total_tokens = torch.zeros((), dtype=torch.int)
    it = iter(micro_batches)
    for _ in micro_batches:
        output, num_tokens = megatron_forward_step(
            forward_step, it, model, len(micro_batches), None, store, config,
            cp_group_size=ps.get_context_parallel_world_size(), is_last_stage=True,
        )
        backward_step(None, output, None, ModelType.encoder_or_decoder, config)
        total_tokens += num_tokens
    finalize_model_grads([model], total_tokens)  # all-reduce the count over DP x CP, divide the gradients
    return store


def report(store: list[dict]) -> dict[str, float]:
    """Megatron-LM's reduction of ``[sum, count]`` pairs (over micro-batches; already reduced over DP by the
    adapter) and of single values (mean over micro-batches)."""
    out = {}
    for key in store[0]:
        vals = torch.stack([s[key] for s in store])
        out[key] = float(vals[:, 0].sum() / vals[:, 1].sum()) if vals.shape[1] == 2 else float(vals.mean())
    return out


def main(rank: int, world: int, port: int, steps: int = 6) -> None:
    from megatron.core import parallel_state as ps

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=2)
        model, config = build_model(tp=2)
        wrapped = SumGradsOverDataParallel(model)
        opt = torch.optim.Adam(model.parameters(), lr=2e-2)
        for step in range(steps):
            batch, reward = rollout(model, step)
            half = batch["labels"].shape[1] // 2  # two micro-batches, cut at a sequence boundary
            micro = [{k: v[:, :half] for k, v in batch.items()}, {k: v[:, half:] for k, v in batch.items()}]
            opt.zero_grad(set_to_none=True)
            stats = report(train_step(wrapped, config, micro))
            opt.step()
            if rank == 0:
                print(f"step {step}: reward {reward:.3f}  policy loss {stats['policy loss']:+.4f}  "
                      f"kl_k3 {stats['kl_k3']:.4f}  weight mean {stats['weight_mean']:.3f}  "
                      f"masked {stats['ratio_below_lower_frac'] + stats['ratio_above_upper_frac']:.3f}  "
                      f"support {stats['support_size']:.1f}  entropy {stats['entropy']:.3f}", flush=True)
        ps.destroy_model_parallel()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    if "RANK" in os.environ:  # torchrun
        main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("MASTER_PORT", 29500)))
    else:
        torch.multiprocessing.spawn(main, args=(2, _free_port()), nprocs=2, join=True)
