"""The Megatron-LM adapter's ``make_loss_func`` refuses broken batches and options on one process (no groups)."""

from __future__ import annotations

import pytest
import torch

from offpolicy.adapters.megatron import make_loss_func


def _batch(b: int = 2, s: int = 3, v: int = 5, seed: int = 0) -> tuple[dict, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, v, (b, s), generator=gen)
    z = torch.randn(b, s, v, generator=gen)
    lq = torch.log_softmax(z + 0.1 * torch.randn(b, s, v, generator=gen), -1).gather(2, labels[..., None])[..., 0]
    batch = dict(labels=labels, sampler_logprobs=lq, advantages=torch.randn(b, s, generator=gen),
                 loss_mask=torch.ones(b, s, dtype=torch.bool))
    return batch, z


def test_valid_batch_gives_a_finite_loss():
    batch, z = _batch()
    loss, count, _ = make_loss_func(batch, use_parallel_state=False)(z)
    assert torch.isfinite(loss) and int(count) == 6


def test_loss_mask_of_two_is_refused():
    batch, _ = _batch()
    batch["loss_mask"] = torch.full((2, 3), 2)
    with pytest.raises(ValueError, match="batch\\['loss_mask'\\] must be bool"):
        make_loss_func(batch, use_parallel_state=False)


def test_vocab_size_wider_than_the_logits_is_refused():
    batch, z = _batch(v=5)
    loss_func = make_loss_func(batch, vocab_size=7, use_parallel_state=False)
    with pytest.raises(ValueError, match="vocab_size=7 is wider than the logits"):
        loss_func(z)


@pytest.mark.parametrize("vocab_size", [0, True, 4.5])
def test_vocab_size_must_be_a_positive_int(vocab_size):
    batch, _ = _batch()
    with pytest.raises(ValueError, match="vocab_size must be an int > 0"):
        make_loss_func(batch, vocab_size=vocab_size, use_parallel_state=False)


def test_labels_as_a_list_is_a_clear_error():
    """Issue 22, finding 8: a list of labels raised ``AttributeError`` from ``.dim()``."""
    batch, _ = _batch()
    batch["labels"] = batch["labels"].tolist()
    with pytest.raises(TypeError, match="batch\\['labels'\\] must be a tensor, got list"):
        make_loss_func(batch, use_parallel_state=False)
