"""``op.advantages``: GRPO, RLOO and Dr. GRPO against hand-worked values."""

from __future__ import annotations

import pytest
import torch

import offpolicy as op


def test_advantages():
    r = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5, 0.5])
    g = torch.tensor([0, 0, 0, 0, 9, 9])
    a = op.advantages.grpo(r, g)
    top = r[:4] - 0.75
    torch.testing.assert_close(a[:4], (top / (top.square().mean().sqrt() + 1e-6)).float())
    assert torch.equal(a[4:], torch.zeros(2))
    torch.testing.assert_close(op.advantages.dr_grpo(r, g)[:4], top)
    loo = op.advantages.rloo(r, g)
    torch.testing.assert_close(loo[0], torch.tensor(1.0 - 2.0 / 3.0))
    torch.testing.assert_close(loo[1], torch.tensor(0.0 - 1.0))
    assert torch.equal(op.advantages.per_token(a, torch.tensor([0, 0, 2])), a[[0, 0, 2]])
    with pytest.raises(ValueError, match="finite"):
        op.advantages.grpo(torch.tensor([float("nan")]), torch.tensor([0]))
    with pytest.raises(ValueError, match="group_ids must have the shape of rewards \\[B\\]"):
        op.advantages.rloo(r, g[:3])


@pytest.mark.parametrize("seq_ids", [torch.tensor([0.0, 1.7]), torch.tensor([0, 1], dtype=torch.uint32), [0, 1]],
                         ids=["float", "uint32", "list"])
def test_per_token_refuses_ids_that_are_not_integers(seq_ids):
    """Issue 22, finding 8: float ids were truncated to another sample's index."""
    with pytest.raises(TypeError, match="seq_ids must be an integer"):
        op.advantages.per_token(torch.randn(3), seq_ids)


def _verl_otb(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared, rollout_is_weights=None,
              handle_zero_tail=False, epsilon=1e-8):
    """Transcribed from verl's ``compute_optimal_token_baseline_advantage`` (volcengine/verl,
    ``verl/trainer/ppo/core_algos.py`` at commit b178a3cd56f58b2d502255daba591e92833930a7, added by PR #4678):
    the same loop over prompt groups, with ``index`` a list."""
    from collections import defaultdict

    batch_size, _ = token_level_rewards.shape
    returns = (token_level_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    w_per_timestep = 1 - 2 * torch.exp(old_log_probs) + sum_pi_squared
    if rollout_is_weights is not None:
        w_per_timestep = w_per_timestep * (rollout_is_weights**2)
    w_cumulative = (w_per_timestep * response_mask).cumsum(dim=-1)
    prompt_groups = defaultdict(list)
    for i in range(batch_size):
        prompt_groups[index[i]].append(i)
    baselines = torch.zeros_like(returns)
    for _, trajectory_indices in prompt_groups.items():
        n = len(trajectory_indices)
        if n == 1:
            continue
        traj_idx = torch.tensor(trajectory_indices)
        returns_group, w_group, mask_group = returns[traj_idx], w_cumulative[traj_idx], response_mask[traj_idx]
        numerator = (returns_group * w_group * mask_group).sum(dim=0)
        denominator = (w_group * mask_group).sum(dim=0) + epsilon
        baselines[traj_idx] = (numerator / denominator).unsqueeze(0).expand(n, -1)
        if handle_zero_tail:
            response_lengths = mask_group.sum(dim=-1)
            sorted_lengths, _ = torch.sort(response_lengths)
            max_length = int(sorted_lengths[-1].item())
            second_max_length = int(sorted_lengths[-2].item())
            max_length_idx = (response_lengths == max_length).nonzero(as_tuple=True)[0]
            if max_length_idx.numel() == 1 and max_length > second_max_length:
                baselines[trajectory_indices[int(max_length_idx[0])], second_max_length:] = 0.0
    return (returns - baselines) * response_mask, returns


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("zero_tail", [False, True])
@pytest.mark.parametrize("with_is", [False, True])
def test_optimal_token_baseline_matches_verl(seed, zero_tail, with_is):
    """Random float64 batches with masks (varying lengths, one empty row) and groups (one of size 1); 1e-9."""
    gen = torch.Generator().manual_seed(seed)
    b, t = 11, 9
    groups = torch.randint(0, 4, (b,), generator=gen)
    groups[0] = 17  # a group of one
    lengths = torch.randint(0, t + 1, (b,), generator=gen)
    lengths[1] = 0
    mask = (torch.arange(t)[None, :] < lengths[:, None]).double()
    rewards = torch.randn(b, t, generator=gen, dtype=torch.float64) * (torch.rand(b, t, generator=gen) < 0.3)
    logp = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 5
    p2 = torch.rand(b, t, generator=gen, dtype=torch.float64)
    rho = torch.rand(b, t, generator=gen, dtype=torch.float64) * 2 if with_is else None
    adv, ret = op.advantages.optimal_token_baseline(rewards, mask, groups, logp, p2, rho, handle_zero_tail=zero_tail)
    want_adv, want_ret = _verl_otb(rewards, mask, groups.tolist(), logp, p2, rho, handle_zero_tail=zero_tail)
    assert adv.dtype == torch.float64
    torch.testing.assert_close(adv, want_adv, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(ret, want_ret, rtol=1e-9, atol=1e-9)
    assert torch.equal(adv[0], ret[0] * mask[0])  # a group of one: no baseline


def test_optimal_token_baseline_refuses_bad_shapes():
    r = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="sum_p2 must be a \\[B, T\\]"):
        op.advantages.optimal_token_baseline(r, torch.ones(2, 3), torch.tensor([0, 0]), r, torch.zeros(2, 2))
    with pytest.raises(TypeError, match="group_ids must be an integer"):
        op.advantages.optimal_token_baseline(r, torch.ones(2, 3), torch.tensor([0.0, 0.0]), r, r)
