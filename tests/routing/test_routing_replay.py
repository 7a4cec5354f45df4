"""Routing replay and capture on tiny transformers MoE models built from a config (offpolicy.routing).

References: the model's own forward (replaying its own routes must reproduce it bit for bit), a float64
re-implementation of a Qwen3-MoE sparse block written here from the expert tensors (no code shared with the hook),
and central finite differences in float64 for the gradient through the recomputed router weights."""

from __future__ import annotations

import pytest
import torch

from offpolicy.routing import capture_routes, moe_layers, replay_routes, replayed_weights, route_dtype
from support.tiny_moe import V, tiny_other_moe, tiny_qwen3_moe

pytest.importorskip("transformers")


def _ids(b: int = 2, t: int = 9, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, V, (b, t), generator=g)


def _random_routes(b, t, n_layers, k, e, seed=3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(b * t * n_layers)]).reshape(b, t, n_layers, k)


def _hooks_left(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("impl", ["eager", "grouped_mm", "batched_mm"])
def test_replaying_own_routes_reproduces_the_logits_exactly(norm, impl):
    model = tiny_qwen3_moe(norm=norm, experts_implementation=impl)
    x = _ids()
    with torch.no_grad():
        natural = model(x).logits
        with capture_routes(model) as cap:
            again = model(x).logits
        with replay_routes(model, cap.routes):
            replayed = model(x).logits
    assert torch.equal(again, natural)
    assert torch.equal(replayed, natural)
    assert cap.routes.shape == (2, 9, 2, 2) and cap.routes.dtype == torch.uint8
    assert [m.decoder_layer for m in moe_layers(model)] == [0, 2]


@pytest.mark.parametrize("kind", ["qwen2_moe", "olmoe"])
def test_other_supported_routers_replay_exactly(kind):
    model = tiny_other_moe(kind)
    x = _ids()
    with torch.no_grad():
        natural = model(x).logits
        with capture_routes(model) as cap:
            model(x)
        with replay_routes(model, cap.routes):
            replayed = model(x).logits
        other = _random_routes(2, 9, cap.routes.shape[2], 2, 8)
        with replay_routes(model, other):
            moved = model(x).logits
    assert torch.equal(replayed, natural)
    assert (moved - natural).abs().max() > 1e-4


def test_replaying_other_routes_changes_exactly_the_routed_layer_and_positions():
    """float64, so the experts' matmul-shape rounding (1e-16) is far below a real change (> 1e-6)."""
    model = tiny_qwen3_moe(dtype=torch.float64, experts_implementation="eager")
    x = _ids(b=2, t=8)
    with torch.no_grad():
        with capture_routes(model) as cap:
            base = model(x, output_hidden_states=True).hidden_states
        for moe_index, dec in [(0, 0), (1, 2)]:
            routes = cap.routes.clone()
            b, t = 1, 4
            own = set(routes[b, t, moe_index].tolist())
            routes[b, t, moe_index] = torch.tensor(sorted(set(range(8)) - own)[:2], dtype=routes.dtype)
            with replay_routes(model, routes):
                hs = model(x, output_hidden_states=True).hidden_states
            # hidden_states[i + 1] is decoder layer i's output
            for i in range(len(hs) - 1):
                diff = (hs[i + 1] - base[i + 1]).abs().amax(-1)                    # [B, T]
                if i < dec:
                    assert diff.max() < 1e-12, (moe_index, i)
                elif i == dec:  # the MLP is per position: only the replayed token moves
                    assert diff[b, t] > 1e-6
                    mask = torch.ones_like(diff, dtype=torch.bool)
                    mask[b, t] = False
                    assert diff[mask].max() < 1e-12
                else:  # causal attention: later positions of the same sequence only
                    assert diff[b, t:].min() > 1e-9 and diff[b, :t].max() < 1e-12 and diff[1 - b].max() < 1e-12


def _reference_block(block, x: torch.Tensor, ids: torch.Tensor, norm: bool, wg: torch.Tensor | None = None):
    """Qwen3-MoE sparse block in float64 from its tensors: y = sum_k w_k * down_e(silu(gate_e x) * up_e x),
    w = softmax(x W_g^T)[ids] (renormalised over ids when norm)."""
    x = x.detach().double().reshape(-1, x.shape[-1])
    wg = block.gate.weight.detach().double() if wg is None else wg
    gate_up = block.experts.gate_up_proj.detach().double()   # [E, 2I, H]
    down = block.experts.down_proj.detach().double()          # [E, H, I]
    inter = gate_up.shape[1] // 2
    rows = []
    for n in range(x.shape[0]):
        z = wg @ x[n]
        p = torch.exp(z - z.max())
        p = p / p.sum()
        w = p[ids[n]]
        if norm:
            w = w / w.sum()
        y = torch.zeros_like(x[n])
        for slot, e in enumerate(ids[n].tolist()):
            h = gate_up[e] @ x[n]
            a = torch.nn.functional.silu(h[:inter]) * h[inter:]
            y = y + w[slot] * (down[e] @ a)
        rows.append(y)
    return torch.stack(rows)


@pytest.mark.parametrize("norm", [True, False])
def test_replayed_block_matches_a_float64_reference(norm):
    model = tiny_qwen3_moe(norm=norm, seed=4)
    x = _ids(seed=5)
    routes = _random_routes(2, 9, 2, 2, 8, seed=6)
    seen = {}
    layer = moe_layers(model)[1]
    handle = layer.block.register_forward_hook(lambda mod, args, out: seen.update(x=args[0], y=out))
    try:
        with torch.no_grad(), replay_routes(model, routes):
            model(x)
    finally:
        handle.remove()
    ref = _reference_block(layer.block, seen["x"], routes[:, :, 1].reshape(-1, 2).long(), norm)
    assert torch.allclose(seen["y"].double().reshape(ref.shape), ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("norm", [True, False])
def test_replayed_weights_are_the_trainers_router_softmax_over_the_replayed_set(norm):
    model = tiny_qwen3_moe(norm=norm, seed=7, router_scale=20.0)
    x = _ids(seed=8)
    routes = _random_routes(2, 9, 2, 2, 8, seed=9)
    logits_seen = []
    layers = moe_layers(model)
    hs = [m.router.register_forward_hook(lambda mod, a, out: logits_seen.append(out[0].detach())) for m in layers]
    try:
        with torch.no_grad(), replay_routes(model, routes), capture_routes(model) as cap:
            model(x)
    finally:
        for h in hs:
            h.remove()
    assert torch.equal(cap.routes.long(), routes)
    for i, z in enumerate(logits_seen):
        p = torch.softmax(z.double(), -1).gather(-1, routes[:, :, i].reshape(-1, 2))
        if norm:
            p = p / p.sum(-1, keepdim=True)
        got = cap.weights[:, :, i].reshape(-1, 2).double()
        assert torch.allclose(got, p, atol=1e-6)
        sums = got.sum(-1)
        if norm:
            assert torch.allclose(sums, torch.ones_like(sums), atol=1e-6)
        else:
            assert (sums < 1).all()


@pytest.mark.parametrize("norm", [True, False])
def test_gradients_flow_through_the_recomputed_router_weights(norm):
    """d loss / d W_gate of a replayed block equals that of the float64 reference block (autograd through the
    reference's own softmax), for random replayed routes; the experts' gradients too."""
    model = tiny_qwen3_moe(norm=norm, seed=10, router_scale=5.0, experts_implementation="eager")
    layer = moe_layers(model)[1]
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(11))
    routes = _random_routes(2, 9, 2, 2, 8, seed=12)
    c = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(13))
    block = layer.block
    with replay_routes(model, routes):
        (block(x) * c).sum().backward()
    assert block.gate.weight.grad.abs().max() > 0
    wg = block.gate.weight.detach().double().requires_grad_(True)
    ref = _reference_block(block, x, routes[:, :, 1].reshape(-1, 2).long(), norm, wg=wg)
    (ref * c.double().reshape(ref.shape)).sum().backward()
    assert torch.allclose(block.gate.weight.grad.double(), wg.grad, atol=1e-5, rtol=1e-4)
    # the natural routing gives another gradient: the replayed one is not the model's own
    block.zero_grad()
    (block(x) * c).sum().backward()
    assert not torch.allclose(block.gate.weight.grad.double(), wg.grad, atol=1e-4)


def test_padded_positions_keep_the_models_own_routing_and_ignore_garbage_ids():
    model = tiny_qwen3_moe(seed=14)
    x = _ids(seed=15)
    attn = torch.ones_like(x)
    attn[0, :3] = 0  # left padding of the first sequence
    with torch.no_grad():
        natural = model(x, attention_mask=attn).logits
        with capture_routes(model) as cap:
            model(x, attention_mask=attn)
        routes = cap.routes.clone()
        routes[0, :3] = torch.tensor([255, 255], dtype=torch.uint8)  # out of range and duplicated: stale rows
        with replay_routes(model, routes, pad_mask=attn == 0):
            replayed = model(x, attention_mask=attn).logits
        alone = model(x[1:]).logits  # batch of one: its own numerics (the experts' matmul shapes differ)
        with capture_routes(model) as cap1:
            model(x[1:])
        with replay_routes(model, cap1.routes[0], pad_mask=torch.zeros(9, dtype=torch.bool)):  # [T, L, K] form
            one = model(x[1:]).logits
    assert torch.equal(replayed, natural)
    assert torch.equal(one, alone)
    assert torch.equal(cap1.routes[0], cap.routes[1])
    with pytest.raises(ValueError, match="routes has expert id 255"):
        with replay_routes(model, routes):
            pass


@pytest.mark.parametrize("case, exc, match", [
    ("dims", ValueError, r"routes must be \[B, T, L, K\]"),
    ("float", TypeError, "routes must hold integer expert ids"),
    ("not_tensor", TypeError, "routes must be a torch.Tensor"),
    ("layers", ValueError, r"routes has L=3 routed layers .*the model has 2"),
    ("topk", ValueError, r"routes has K=3 experts .*top_k=\[2\]"),
    ("range", ValueError, r"routes has expert id 8 out of range \[0, 8\) at \(batch, token\) \(1, 5\), layer 1"),
    ("negative", ValueError, r"routes has expert id -1 out of range"),
    ("duplicate", ValueError, r"routes repeats an expert .*\(0, 2\), layer 0"),
    ("mask_shape", ValueError, r"pad_mask must be \[B, T\]"),
    ("mask_dtype", TypeError, "pad_mask must be a bool tensor"),
    ("rows", ValueError, r"routes cover B x T = 2 x 8 = 16 token rows, but the router of layer 0"),
])
def test_errors_name_the_argument(case, exc, match):
    model = tiny_qwen3_moe(seed=16)
    x = _ids()
    with torch.no_grad(), capture_routes(model) as cap:
        model(x)
    routes, mask = cap.routes.long(), None
    if case == "dims":
        routes = routes[0, 0]
    elif case == "float":
        routes = routes.float()
    elif case == "not_tensor":
        routes = routes.tolist()
    elif case == "layers":
        routes = torch.cat([routes, routes[:, :, :1]], dim=2)
    elif case == "topk":
        routes = torch.cat([routes, (routes[..., :1] + 1) % 8], dim=3)
    elif case == "range":
        routes[1, 5, 1, 0] = 8
    elif case == "negative":
        routes[0, 0, 0, 1] = -1
    elif case == "duplicate":
        routes[0, 2, 0, 1] = routes[0, 2, 0, 0]
    elif case == "mask_shape":
        mask = torch.zeros(2, 8, dtype=torch.bool)
    elif case == "mask_dtype":
        mask = torch.zeros(2, 9, dtype=torch.long)
    elif case == "rows":
        routes = routes[:, :8]
    before = model(x).logits.detach()
    with pytest.raises(exc, match=match):
        with torch.no_grad(), replay_routes(model, routes, pad_mask=mask):
            model(x)
    assert _hooks_left(model) == 0
    assert torch.equal(model(x).logits.detach(), before)


def test_models_without_a_supported_router_are_refused():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    dense = Qwen3ForCausalLM(Qwen3Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    with pytest.raises(ValueError, match="replay_routes: model has no supported MoE router"):
        with replay_routes(dense, torch.zeros(1, 1, 1, 2, dtype=torch.long)):
            pass
    with pytest.raises(TypeError, match="capture_routes: model must be a torch.nn.Module"):
        with capture_routes("qwen"):
            pass
    compiled = torch.compile(tiny_qwen3_moe())
    with pytest.raises(TypeError, match="torch.compile'd module"):
        with replay_routes(compiled, torch.zeros(1, 1, 2, 2, dtype=torch.long)):
            pass


def test_the_hooks_are_removed_on_exit_and_on_an_exception():
    model = tiny_qwen3_moe(seed=17)
    x = _ids()
    with torch.no_grad():
        natural = model(x).logits
        routes = _random_routes(2, 9, 2, 2, 8, seed=18)
        with replay_routes(model, routes):
            moved = model(x).logits
        assert not torch.equal(moved, natural)
        assert _hooks_left(model) == 0 and torch.equal(model(x).logits, natural)
        with pytest.raises(KeyError, match="boom"):
            with replay_routes(model, routes):
                model(x)
                raise KeyError("boom")
        assert _hooks_left(model) == 0 and torch.equal(model(x).logits, natural)
        with pytest.raises(KeyError, match="boom"):
            with capture_routes(model):
                model(x)
                raise KeyError("boom")
        assert _hooks_left(model) == 0 and torch.equal(model(x).logits, natural)


def test_capture_concatenates_a_kv_cache_decode_along_the_sequence():
    model = tiny_qwen3_moe(seed=19, dtype=torch.float64, router_scale=10.0, experts_implementation="eager")
    x = _ids(b=2, t=10, seed=20)
    with torch.no_grad():
        with capture_routes(model) as full:
            model(x)
        with capture_routes(model) as steps:
            out = model(x[:, :6], use_cache=True)
            cache = out.past_key_values
            for i in range(6, 10):
                out = model(x[:, i:i + 1], cache=cache, use_cache=True)
                cache = out.past_key_values
    assert torch.equal(steps.routes, full.routes)
    assert torch.allclose(steps.weights, full.weights, atol=1e-6)
    with pytest.raises(RuntimeError, match="no forward ran"):
        with capture_routes(model):
            pass


def test_route_dtype_is_the_smallest_that_holds_the_ids():
    assert route_dtype(8) == torch.uint8 and route_dtype(256) == torch.uint8
    assert route_dtype(257) == torch.int16 and route_dtype(40000) == torch.int32


def test_replayed_weights_match_the_models_own_top_k_weights():
    g = torch.Generator().manual_seed(21)
    z = torch.randn(50, 16, generator=g, dtype=torch.float32) * 3
    for norm in (True, False):
        p = torch.softmax(z, -1, dtype=torch.float)
        top, idx = torch.topk(p, 4, -1)
        if norm:
            top /= top.sum(-1, keepdim=True)
        assert torch.equal(replayed_weights(z, idx, norm), top)


# ------------------------------------------------------------------------------------- RoutedExperts records


def test_captured_records_carry_padding_as_valid_and_replay_like_the_tensors():
    """capture -> ``RoutedExperts`` per row (padded positions: ``valid`` False, fill 0, never the model's routes
    there) -> ``replay_routes``: the same logits as the tensor form with ``pad_mask``, and the model's own forward."""
    import offpolicy as op

    model = tiny_qwen3_moe(seed=21)
    x = _ids(seed=22)
    attn = torch.ones_like(x)
    attn[0, :3] = 0
    pad = attn == 0
    with torch.no_grad():
        natural = model(x, attention_mask=attn).logits
        with capture_routes(model) as cap:
            model(x, attention_mask=attn)
        recs = cap.to_records(pad_mask=pad)
        with replay_routes(model, recs):
            from_records = model(x, attention_mask=attn).logits
        with replay_routes(model, cap.routes, pad_mask=pad):
            from_tensor = model(x, attention_mask=attn).logits
    assert len(recs) == 2 and all(isinstance(r, op.RoutedExperts) for r in recs)
    assert recs[0].ids.dtype == torch.uint8 and recs[0].ids.shape == (9, 2, 2)
    assert recs[0].valid.tolist() == [False] * 3 + [True] * 6 and recs[1].valid.all()
    assert int(recs[0].ids[:3].abs().sum()) == 0 and float(recs[0].weights[:3].abs().sum()) == 0.0
    assert torch.equal(recs[0].ids[3:], cap.routes[0, 3:]) and torch.equal(recs[1].ids, cap.routes[1])
    assert torch.equal(recs[1].weights, cap.weights[1])
    assert torch.equal(from_records, natural) and torch.equal(from_tensor, natural)
    # no mask: valid None, every row kept as captured
    assert cap.to_records()[0].valid is None and torch.equal(cap.to_records()[0].ids, cap.routes[0])


def test_a_record_dense_or_csr_replays_like_the_tensor_form():
    """A sampler's routes given as one record (dense, CSR, or a list of one) replay to exactly what the tensor form
    gives (which ``test_replayed_block_matches_a_float64_reference`` checks against float64); a padded token keeps
    the model's own routing."""
    import offpolicy as op

    model = tiny_qwen3_moe(seed=23)
    x = _ids(b=1, seed=24)
    routes = _random_routes(1, 9, 2, 2, 8, seed=25)
    valid = torch.ones(9, dtype=torch.bool)
    valid[[0, 4]] = False
    with torch.no_grad():
        with capture_routes(model) as cap:
            model(x)
        mixed = torch.where(valid[None, :, None, None], routes, cap.routes.long())  # padded: the model's own
        with replay_routes(model, mixed):
            expect = model(x).logits
        fill = torch.where(valid[:, None, None], routes[0], 0)
        rec = op.RoutedExperts.from_ids(fill, 8, valid=valid)
        with replay_routes(model, rec):
            dense = model(x).logits
        with replay_routes(model, rec.to_csr()):
            csr = model(x).logits
        with replay_routes(model, [rec], pad_mask=torch.zeros(9, dtype=torch.bool)):  # a list; the mask ORed in
            listed = model(x).logits
        natural = model(x).logits
    assert torch.equal(dense, expect) and torch.equal(csr, expect) and torch.equal(listed, expect)
    assert not torch.allclose(dense, natural)  # the random routes do move the logits


@pytest.mark.parametrize("case, exc, match", [
    ("experts", ValueError, r"routes\[0\].num_experts=16, the model's routers hold \[8\]"),
    ("lengths", ValueError, r"unequal numbers of rows \[8, 9\]"),
    ("varying_k", ValueError, r"routes\[0\]: RoutedExperts.offsets: the top-k varies"),
    ("empty", TypeError, "routes must be a torch.Tensor of expert ids, a RoutedExperts or a non-empty list"),
    ("layers", ValueError, r"routes has L=3 routed layers"),
    ("mask", ValueError, r"pad_mask must be \[B, T\] = \(1, 9\) like the records"),
])
def test_record_errors_name_the_argument(case, exc, match):
    import offpolicy as op

    model = tiny_qwen3_moe(seed=26)
    ids = _random_routes(1, 9, 2, 2, 8, seed=27)[0]
    routes: object = op.RoutedExperts.from_ids(ids, 8)
    mask = None
    if case == "experts":
        routes = op.RoutedExperts.from_ids(ids, 16)
    elif case == "lengths":
        routes = [op.RoutedExperts.from_ids(ids[:8], 8), routes]
    elif case == "varying_k":
        off = torch.cat([torch.tensor([0, 1]), 1 + 2 * torch.arange(1, 18)])  # row 0 holds 1 expert, the rest 2
        routes = op.RoutedExperts.from_csr(ids.reshape(-1)[1:], off, 8, 2)
    elif case == "empty":
        routes = []
    elif case == "layers":
        routes = op.RoutedExperts.from_ids(_random_routes(1, 9, 3, 2, 8, seed=28)[0], 8)
    elif case == "mask":
        mask = torch.zeros(8, dtype=torch.bool)
    with pytest.raises(exc, match=match):
        with replay_routes(model, routes, pad_mask=mask):
            pass
