"""Routing records through the adapters (issue 46 item 2): the vLLM and SGLang parsers on fixtures written in the
engines' documented layouts (vLLM: base64 ``.npy`` of ``[prompt + output - 1, layers, top_k]`` in
``choices[i].routed_experts``, or the offline array; SGLang: base64 raw ``int32`` bytes, flat, in
``meta_info.routed_experts``; the commits are cited in the adapters' docstrings), then ``collate`` of multi-turn
trajectories against a padded reference: a ``[B, L_seq, layers, K]`` tensor of every position's routes, indexed at
each token's ``(row, col - 1)``. The context-parallel split is tested in tests/distributed/test_routes_cp.py."""

from __future__ import annotations

import base64
from types import SimpleNamespace

import pytest
import torch

from offpolicy import route_flips
from offpolicy.adapters import sglang, vllm
from offpolicy.adapters.common import RecordError, Trajectory, TurnRecord, collate
from offpolicy.records.routed_experts import RoutedExperts
from support.route_payloads import npy_b64 as _npy_b64
from support.route_payloads import positions

np = pytest.importorskip("numpy")

E, LAYERS, K = 16, 3, 2


def _positions(n, seed, layers=LAYERS, k=K, e=E):
    return positions(n, seed, layers, k, e)


@pytest.mark.parametrize("dtype", ["int16", "uint8", "int32", "int64", "uint16"])
def test_vllm_http_npy_payload(dtype):
    p, t = 5, 4
    pos = _positions(p + t - 1, 0)
    resp = {"choices": [{"index": 0, "text": "", "routed_experts": _npy_b64(pos.astype(dtype))}],
            "usage": {"prompt_tokens": p, "completion_tokens": t}}
    rec = vllm.parse_routed_experts(resp, num_experts=E, prompt_len=p, num_tokens=t, num_layers=LAYERS)
    assert rec.ids.dtype == torch.uint8 and rec.num_tokens == t
    # output token j is predicted at position p - 1 + j
    assert rec.ids.long().tolist() == pos[p - 1:].tolist()


def test_vllm_offline_array_and_attach():
    p, t = 3, 5
    pos = _positions(p + t - 1, 1)
    out = SimpleNamespace(outputs=[SimpleNamespace(routed_experts=pos.astype(np.int32))],
                          prompt_token_ids=list(range(p)))
    rec = vllm.parse_routed_experts(out, num_experts=E, prompt_len=p, num_tokens=t)
    assert rec.ids.long().tolist() == pos[p - 1:].tolist()
    turn = TurnRecord(input_ids=tuple(range(p)), tokens=torch.arange(t), sampler_logprobs=torch.full((t,), -1.0),
                      candidates=None, temperature=1.0, top_p=1.0, top_k=None)
    got = vllm.attach_routed_experts(turn, out, num_experts=E)
    assert torch.equal(got.routes.ids, rec.ids)


def test_vllm_malformed_payloads_name_the_field():
    p, t = 4, 3
    good = _positions(p + t - 1, 2)
    cases = [
        ({"choices": [{"index": 0}]}, "choices\\[0\\].routed_experts is missing"),
        ({"choices": [{"index": 0, "routed_experts": "@@"}]}, "routed_experts is not valid base64"),
        ({"choices": [{"index": 0, "routed_experts": base64.b64encode(b"junk").decode()}]}, "not a .npy payload"),
        ({"choices": [{"index": 0, "routed_experts": _npy_b64(good[:-1])}]}, "routed_experts holds 5 positions"),
        ({"choices": [{"index": 0, "routed_experts": _npy_b64(good.astype(np.float32))}]}, "routed_experts: dtype"),
        ({"choices": [{"index": 0, "routed_experts": _npy_b64(good)}], "usage": {"prompt_tokens": 9}},
         "usage.prompt_tokens = 9"),
    ]
    for resp, match in cases:
        with pytest.raises(RecordError, match=match):
            vllm.parse_routed_experts(resp, num_experts=E, prompt_len=p, num_tokens=t)
    with pytest.raises(RecordError, match="holds 3 MoE layers, the model has 4: layers missing"):
        vllm.parse_routed_experts({"choices": [{"index": 0, "routed_experts": _npy_b64(good)}]}, num_experts=E,
                                  prompt_len=p, num_tokens=t, num_layers=4)
    stale = good.copy()
    stale[p, 1, 1] = stale[p, 1, 0]
    with pytest.raises(RecordError, match="routed_experts: RoutedExperts.ids: duplicate expert within token 1"):
        vllm.parse_routed_experts({"choices": [{"index": 0, "routed_experts": _npy_b64(stale)}]}, num_experts=E,
                                  prompt_len=p, num_tokens=t)


@pytest.mark.parametrize("wire", [None, "int32", "uint16", "uint8"])
def test_sglang_raw_payload(wire):
    p, t = 6, 3
    pos = _positions(p + t - 1, 3)
    meta = {"id": "r1", "prompt_tokens": p,
            "routed_experts": base64.b64encode(pos.astype(wire or "int32").tobytes()).decode()}
    if wire is not None:
        meta["routed_experts_dtype"] = wire
    resp = {"output_ids": [7, 8, 9], "meta_info": meta}
    req = sglang.build_request(list(range(p)), max_new_tokens=t, return_routed_experts=True)
    assert req["return_routed_experts"] is True
    rec = sglang.parse_routed_experts(resp, req, num_experts=E, num_hidden_layers=LAYERS, top_k=K)
    assert rec.ids.long().tolist() == pos[p - 1:].tolist()


def test_sglang_dense_layers_are_left_out_with_moe_layers():
    # a model whose layer 0 is dense: the engine records zeros there (every slot the same expert)
    p, t = 2, 3
    pos = _positions(p + t - 1, 4, layers=LAYERS + 1)
    pos[:, 0] = 0
    resp = {"output_ids": [1, 2, 3], "meta_info": {"routed_experts": base64.b64encode(
        pos.astype(np.int32).tobytes()).decode()}}
    req = {"input_ids": [0] * p}
    with pytest.raises(RecordError, match="missing layer"):
        sglang.parse_routed_experts(resp, req, num_experts=E, num_hidden_layers=LAYERS + 1, top_k=K)
    rec = sglang.parse_routed_experts(resp, req, num_experts=E, num_hidden_layers=LAYERS + 1, top_k=K,
                                      moe_layers=[1, 2, 3], num_layers=LAYERS)
    assert rec.ids.long().tolist() == pos[p - 1:, 1:].tolist()


def test_sglang_malformed_payloads_name_the_field():
    p, t = 3, 2
    pos = _positions(p + t - 1, 5)
    raw = pos.astype(np.int32).tobytes()
    req = {"input_ids": [0] * p}
    kw = dict(num_experts=E, num_hidden_layers=LAYERS, top_k=K)
    cases = [
        ({"output_ids": [1, 2], "meta_info": {}}, "meta_info lacks routed_experts"),
        ({"output_ids": [1, 2], "meta_info": {"routed_experts": 5}}, "routed_experts must be a base64 string"),
        ({"output_ids": [1, 2], "meta_info": {"routed_experts": base64.b64encode(raw[:-4]).decode()}},
         "not a whole number of"),
        ({"output_ids": [1, 2], "meta_info": {"routed_experts": base64.b64encode(raw).decode(),
                                              "routed_experts_dtype": "float32"}}, "routed_experts_dtype"),
        ({"output_ids": [1, 2, 3], "meta_info": {"routed_experts": base64.b64encode(raw).decode()}},
         "routed_experts holds 4 positions; prompt \\(3\\) \\+ output \\(3\\) - 1 = 5"),
        ({"output_ids": [1, 2], "meta_info": {"routed_experts": base64.b64encode(raw).decode(),
                                              "prompt_tokens": 7}}, "prompt_tokens = 7"),
    ]
    for resp, match in cases:
        with pytest.raises(RecordError, match=match):
            sglang.parse_routed_experts(resp, req, **kw)
    big = pos.copy()
    big[-1, 0, 0] = E + 3
    with pytest.raises(RecordError, match="meta_info.routed_experts: RoutedExperts.ids: expert id 19 is out of range"):
        sglang.parse_routed_experts({"output_ids": [1, 2], "meta_info": {
            "routed_experts": base64.b64encode(big.astype(np.int32).tobytes()).decode()}}, req, **kw)


def _turn(context, t, positions_of_sequence, seed, csr=False):
    """A sampled turn after ``context`` tokens whose routes are the reference positions' rows."""
    p = len(context)
    routes = RoutedExperts.from_ids(torch.as_tensor(positions_of_sequence[p - 1:p - 1 + t]), E)
    if csr:
        routes = routes.to_csr()
    g = torch.Generator().manual_seed(seed)
    return TurnRecord(input_ids=tuple(context), tokens=torch.randint(0, 50, (t,), generator=g),
                      sampler_logprobs=-torch.rand(t, generator=g), candidates=None, temperature=1.0, top_p=1.0,
                      top_k=None, routes=routes)


@pytest.mark.parametrize("csr", [False, True])
def test_collate_keeps_routes_aligned_with_the_padded_reference(csr):
    b, length = 3, 30
    ref = torch.as_tensor(np.stack([_positions(length, 10 + i) for i in range(b)]))     # [B, L_seq, layers, K]
    trajs = []
    for i in range(b):
        traj = Trajectory(list(range(3 + i)))
        for j in range(2):
            t = 2 + i + j
            traj.add_turn(_turn(traj.input_ids, t, ref[i].numpy(), seed=i * 10 + j, csr=csr and j == 1))
            traj.add_tokens([99] * (1 + j))          # a tool output between turns: not sampled
        trajs.append(traj)
    seqs, batch = collate(trajs)
    assert batch.routes is not None and batch.routes.num_tokens == batch.tokens.shape[0]
    assert batch.routes.is_csr == csr
    # the token at (row, col) is predicted at position col - 1: its routes are the reference's there
    want = ref[batch.rows, batch.cols - 1]
    assert torch.equal(batch.routes.to_dense().ids.long(), want)


def test_collate_refuses_a_turn_without_routes():
    ref = _positions(20, 0)
    traj = Trajectory([1, 2, 3])
    traj.add_turn(_turn(traj.input_ids, 3, ref, 0))
    bare = _turn(traj.input_ids, 2, ref, 1)
    traj.add_turn(TurnRecord(**{**bare.__dict__, "routes": None}))
    with pytest.raises(ValueError, match=r"trajectories\[0\] turn 1 carries no routes"):
        collate([traj])


def test_turn_record_refuses_misaligned_routes():
    ref = _positions(10, 0)
    turn = _turn([1, 2], 3, ref, 0)
    with pytest.raises(ValueError, match="One row short"):
        turn.with_routes(turn.routes.take_rows(torch.arange(2)))


def test_trainer_routes_gathered_at_the_sampled_positions_agree():
    """The trainer's per-position routes of the padded batch, gathered by ``TokenBatch.gather_routes``, equal the
    sampler's collated routes when both routed alike, and ``route_flips`` counts a planted flip at its token."""
    b, length = 2, 24
    ref = torch.as_tensor(np.stack([_positions(length, 30 + i) for i in range(b)]))
    trajs = []
    for i in range(b):
        traj = Trajectory(list(range(4)))
        traj.add_turn(_turn(traj.input_ids, 5 + i, ref[i].numpy(), seed=i))
        trajs.append(traj)
    _, batch = collate(trajs)
    trainer = batch.gather_routes(ref, E)
    assert torch.equal(trainer.ids, batch.routes.ids)
    flipped = ref.clone()
    r, c = int(batch.rows[3]), int(batch.cols[3]) - 1
    flipped[r, c, 1] = torch.tensor([x for x in range(E) if x not in ref[r, c, 1].tolist()][:K])
    assert route_flips(batch.routes, batch.gather_routes(flipped, E)).tolist() == [
        1 if j == 3 else 0 for j in range(batch.tokens.shape[0])]
    with pytest.raises(ValueError, match="ids must be"):
        batch.gather_routes(ref[0], E)
