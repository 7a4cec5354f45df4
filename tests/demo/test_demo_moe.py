"""The demo's mixture-of-experts policy (grid C): the MoE forward against a float64 per-token loop that shares no code
with it, routing replay, route flips under the fleet's quantised numerics, and an end-to-end replay run."""

import math

import pytest
import torch

from offpolicy.demo.model import ModelConfig, TinyLM, route_flips
from offpolicy.demo.simulated_fleet import build_fleet, sampler_copy
from offpolicy.demo.task import SortTask
from offpolicy.demo.train import RunConfig, run
from offpolicy.demo.warmup import WarmupConfig, expected_success, warmup

TASK = SortTask(n_items=5, max_value=30, vocab=40)
MOE = ModelConfig(vocab_size=TASK.vocab_size, max_len=TASK.seq_len, d_model=16, n_layers=2, n_heads=2, d_ff=32,
                  n_experts=4, top_k=2)


def _loop_moe(moe, x):
    """float64 reference: for each token, its own router logits, softmax, top-k, renormalise, and the sum of the
    chosen experts' GELU MLPs, written out one token at a time (no batched gather, no index_add)."""
    wr = moe.router_weight.detach().double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    ids = []
    for n in range(x.shape[0]):
        xn = x[n].double()
        z = [float((wr[e] * xn).sum()) for e in range(wr.shape[0])]
        p = [math.exp(v - max(z)) for v in z]
        p = [v / sum(p) for v in p]
        chosen = sorted(range(len(z)), key=lambda e: -z[e])[: moe.top_k]
        norm = sum(p[e] for e in chosen)
        for e in chosen:
            ex = moe.experts[e]
            h = ex.fc1.weight.detach().double() @ xn + ex.fc1.bias.detach().double()
            h = 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))
            out[n] += p[e] / norm * (ex.fc2.weight.detach().double() @ h + ex.fc2.bias.detach().double())
        ids.append(sorted(chosen))
    return out, ids


@pytest.mark.parametrize("hostile", [False, True])
def test_moe_forward_equals_a_per_token_loop(hostile):
    torch.manual_seed(0)
    model = TinyLM(MOE)
    moe = model.blocks[0].moe
    with torch.no_grad():
        moe.router_weight.normal_(0, 1.0)   # routes well separated: fp32 and float64 pick the same experts
        for ex in moe.experts:
            ex.fc1.weight.normal_(0, 0.5)
            ex.fc1.bias.normal_(0, 0.5)
    x = torch.randn(37, MOE.d_model)
    if hostile:   # large rows, a zero row, and a row that sends almost all tokens' mass to one expert
        x[0] *= 100
        x[1] = 0
        x[2] = moe.router_weight[3].detach() * 10
    y, used, natural = moe(x)
    ref, ref_ids = _loop_moe(moe, x)
    assert torch.equal(used, natural)
    assert [sorted(r) for r in natural.tolist()] == ref_ids or hostile  # the zero row ties every expert
    live = torch.ones(37, dtype=torch.bool)
    live[1] = not hostile
    assert torch.allclose(y[live].double(), ref[live], rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_replay_forces_the_given_routes_and_its_own_routes_reproduce_the_forward():
    torch.manual_seed(1)
    model = TinyLM(MOE)
    ids = torch.randint(0, TASK.vocab_size, (6, 9))
    base = model(ids)
    own = model.last_routes.clone()
    model.replay = own
    assert torch.equal(model(ids), base)          # replaying its own routes is the same forward, bit for bit
    other = torch.stack([torch.randperm(4)[:2] for _ in range(6 * 9 * 2)]).view(6, 9, 2, 2)
    model.replay = other
    out = model(ids)
    assert torch.equal(model.last_routes, other)
    # the first layer's own router sees the same input; later layers see the replayed layers' outputs
    assert torch.equal(model.last_natural_routes[:, :, 0], own[:, :, 0])
    assert not torch.allclose(out, base)
    model.replay = other[:, :4]
    with pytest.raises(ValueError, match=r"replay must be \[B, T, L, K\]"):
        model(ids)
    model.replay = other + 4
    with pytest.raises(ValueError, match="expert ids in"):
        model(ids)
    with pytest.raises(ValueError, match="top_k"):
        ModelConfig(n_experts=2, top_k=3)


def test_gradient_reaches_the_router_under_replay():
    torch.manual_seed(2)
    model = TinyLM(MOE)
    ids = torch.randint(0, TASK.vocab_size, (3, 7))
    model(ids)
    model.replay = model.last_routes.flip(-1)   # same sets, other slot order
    model(ids).sum().backward()
    assert all(float(b.moe.router_weight.grad.abs().sum()) > 0 for b in model.blocks)


def test_quantised_samplers_flip_routes_and_the_dense_cache_key_is_unchanged():
    torch.manual_seed(3)
    model = TinyLM(ModelConfig(vocab_size=64, max_len=16, n_experts=4, top_k=2))
    ids = torch.randint(0, 64, (32, 16))
    model(ids)
    trainer_routes = model.last_natural_routes
    frac = {}
    for fmt in ("bf16", "mxfp4"):
        copy = sampler_copy(model, build_fleet("mixed", 0.0, fmt)[0])
        copy(ids)
        frac[fmt] = float(route_flips(copy.last_natural_routes, trainer_routes).float().mean())
    fp32 = sampler_copy(model, build_fleet("onpolicy", 0.0)[0])
    fp32(ids)
    assert torch.equal(fp32.last_natural_routes, trainer_routes)
    assert 0 < frac["bf16"] < frac["mxfp4"] < 0.5, frac
    # a dense config's dict (the warm-up cache key) has no expert fields
    assert "n_experts" not in ModelConfig().to_dict() and ModelConfig(n_experts=2).to_dict()["n_experts"] == 2


def test_replay_run_trains_on_the_samplers_routes(tmp_path):
    state, _ = warmup(TASK, MOE, WarmupConfig(max_steps=2, batch=16, probe=16), tmp_path)
    common = dict(fleet="mixed", weight_format="bf16", staleness=0.0, seed=0, steps=1, prompts=4, samples=2,
                  eval_every=1, eval_prompts=4, eval_samples=2, pass_k=1, probe_prefixes=2)
    plain = run(RunConfig(arm="grpo", **common), TASK, MOE, state)
    rr = run(RunConfig(arm="rr_tis", tag="x", mis_bounds=(0.2, 4.0), **common), TASK, MOE, state)
    assert rr["run_id"] == "rr_tis@mixed:bf16~x/s0"
    # the first step's batch and sampler routes are the same in both runs (same seed, same weights); the flip
    # share is measured on the trainer's own router either way, and replay lowers the mismatch it leaves
    h0, r0 = plain["history"][0], rr["history"][0]
    assert h0["reward"] == r0["reward"] and h0["route_flip"] == r0["route_flip"]
    assert 0 < h0["route_flip"] < 0.5 and len(h0["route_flip_by_group"]) == len(plain["groups"])
    assert r0["kl_full"] < h0["kl_full"]
    for key in ("success_exact", "success_exact_topp"):
        assert 0 <= rr["evals"][-1][key] <= 1
    with pytest.raises(ValueError, match="needs experts"):
        dense = ModelConfig(vocab_size=TASK.vocab_size, max_len=TASK.seq_len, d_model=16, n_layers=1, n_heads=2,
                            d_ff=32)
        run(RunConfig(arm="rr_tis", **common), TASK, dense, {})


def test_nucleus_success_is_the_renormalised_nucleus_probability():
    torch.manual_seed(4)
    model = TinyLM(MOE)
    numbers = TASK.sample_numbers(3, torch.Generator().manual_seed(0))
    seq = torch.cat([TASK.prompts(numbers), TASK.answers(numbers)], 1)
    p = torch.softmax(model(seq[:, :-1]).detach().double(), -1)[:, TASK.prompt_len - 1:]
    want = []
    for b in range(3):
        prob = 1.0
        for t in range(TASK.answer_len):
            row = p[b, t]
            order = row.argsort(descending=True)
            kept, mass = [], 0.0
            for v in order.tolist():   # keep while the mass before the token is <= top_p
                if mass <= 0.5:
                    kept.append(v)
                mass += float(row[v])
            y = int(seq[b, TASK.prompt_len + t])
            prob *= float(row[y]) / sum(float(row[v]) for v in kept) if y in kept else 0.0
        want.append(prob)
    got = expected_success(model, TASK, numbers, top_p=0.5)
    assert got.double().tolist() == pytest.approx(want, rel=1e-4, abs=1e-12)
    assert torch.allclose(expected_success(model, TASK, numbers, top_p=1.0), expected_success(model, TASK, numbers))
    with pytest.raises(ValueError, match="top_p"):
        expected_success(model, TASK, numbers, top_p=0.0)


def test_fleet_copies_shared_between_groups_of_one_format_equal_fresh_copies():
    from offpolicy.demo.simulated_fleet import SimulatedFleet

    torch.manual_seed(5)
    model = TinyLM(MOE)
    groups = build_fleet("mixed", 0.0, "seed")
    fleet = SimulatedFleet(groups, model, torch.Generator().manual_seed(0))
    for g, copy in zip(groups, fleet.models):
        fresh = sampler_copy(model, g)
        assert copy.attn_impl == g.attn_impl and copy.kv_quant is fresh.kv_quant
        assert all(torch.equal(a, b) for a, b in zip(copy.state_dict().values(), fresh.state_dict().values()))
    assert fleet.models[0] is not fleet.models[1]
    # A sync updates each copy in place: equal to a fresh copy of the new weights, no storage shared between groups.
    with torch.no_grad():
        for t in model.parameters():
            t.add_(0.01 * torch.randn_like(t))
    fleet.after_step(model, 1)
    assert fleet.versions == [1] * len(groups)
    for g, copy in zip(groups, fleet.models):
        fresh = sampler_copy(model, g)
        assert all(torch.equal(a, b) for a, b in zip(copy.state_dict().values(), fresh.state_dict().values()))
    ptrs = [t.data_ptr() for m in fleet.models for t in m.state_dict().values()]
    assert len(set(ptrs)) == len(ptrs)


def test_kv_fp8_is_round_to_e4m3_bit_for_bit():
    from offpolicy.demo.simulated_fleet import kv_fp8
    from offpolicy.fleet.quant.formats import round_to_e4m3

    # Every finite bf16 value (the samplers' compute dtype), both zeros, subnormals, ties, and beyond +-448.
    b = torch.arange(0, 65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    b = b[torch.isfinite(b)]
    got = kv_fp8(b)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.float().view(torch.int32), round_to_e4m3(b.float()).view(torch.int32))
    # fp32: random magnitudes over 16 decades, exact E4M3 midpoints (ties to even) and saturation.
    g = torch.Generator().manual_seed(3)
    x = torch.randn(20000, generator=g) * torch.logspace(-12, 4, 20000)
    grid = round_to_e4m3(torch.linspace(-448, 448, 4001))
    ties = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([x, ties, torch.tensor([464.0, -464.0, 480.0, 1e30, -0.0, 2.0 ** -10, 3 * 2.0 ** -11])])
    assert torch.equal(kv_fp8(x).view(torch.int32), round_to_e4m3(x).view(torch.int32))
    for bad in (math.nan, math.inf):
        with pytest.raises(ValueError, match="kv_fp8"):
            kv_fp8(torch.tensor([1.0, bad]))


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_the_samplers_last_forward_is_the_rescoring_forward(top_p):
    from offpolicy.demo.rollout import rollout
    from offpolicy.demo.train import _rescore

    torch.manual_seed(6)
    model = TinyLM(MOE)
    prompts = TASK.prompts(TASK.sample_numbers(12, torch.Generator().manual_seed(1)))
    for g in build_fleet("mixed", 0.0, "nvfp4")[:2]:
        copy = sampler_copy(model, g)
        out = rollout(copy, prompts, TASK.answer_len, temperature=1.0, top_p=top_p, head_k=4,
                      generator=torch.Generator().manual_seed(2))
        routes = copy.last_routes.clone()
        p = prompts.shape[1]
        assert out.last_logits is not None and out.last_logits.shape[:2] == (12, p + TASK.answer_len - 1)
        q = torch.softmax(out.last_logits[:, p - 1:].float(), -1)
        assert torch.equal(q, _rescore(copy, prompts, out.tokens, 1.0))
        assert torch.equal(routes, copy.last_routes)
