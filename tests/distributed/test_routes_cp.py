"""The Megatron context-parallel split of a routing record (issue 46 item 2): on every rank, for the ``bshd`` zigzag
and the ``thd`` split, dense and CSR records with padded positions and router weights, the split record equals the
padded reference ``[B, S, layers, K]`` split along the sequence dimension with the same index (what
``split_for_context_parallel`` does to the batch's tensors)."""

from __future__ import annotations

import random

import pytest
import torch

from offpolicy.adapters.megatron import split_routes_for_context_parallel
from offpolicy.parallel.packing import thd_cp_index, zigzag_index
from offpolicy.records.routed_experts import PAD_FILL, RoutedExperts

E, LAYERS, K = 16, 3, 2


def _positions(n, seed):
    rng = random.Random(seed)
    return torch.tensor([[rng.sample(range(E), K) for _ in range(LAYERS)] for _ in range(n)])


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_cp_split_matches_the_padded_reference(cp, layout):
    b, s = 2, 16
    ref = torch.stack([_positions(s, 20 + i) for i in range(b)])           # [B, S, layers, K]
    valid = torch.rand(b, s, generator=torch.Generator().manual_seed(cp)) > 0.25       # padded positions
    ids = torch.where(valid[..., None, None], ref, PAD_FILL)
    weights = torch.where(valid[..., None, None], torch.rand(b, s, LAYERS, K), 0.0)
    rec = RoutedExperts.from_ids(ids.reshape(b * s, LAYERS, K), E, valid=valid.reshape(-1),
                                 weights=weights.reshape(b * s, LAYERS, K))
    cu = torch.tensor([0, 8, 16]) if layout == "thd" else None
    for r in range(cp):
        idx = zigzag_index(s, cp, r) if cu is None else thd_cp_index(cu, cp, r)
        for form in (rec, rec.to_csr()):
            part = split_routes_for_context_parallel(form, b, s, cp, r, cu)
            assert part.is_csr == form.is_csr and part.num_tokens == b * s // cp
            dense = part.to_dense()
            assert torch.equal(dense.ids.long(), ids.index_select(1, idx).reshape(-1, LAYERS, K))
            assert torch.equal(dense.valid, valid.index_select(1, idx).reshape(-1))
            assert torch.equal(dense.weights, weights.index_select(1, idx).reshape(-1, LAYERS, K))
    with pytest.raises(ValueError, match="routed_experts: 32 token rows for 30"):
        split_routes_for_context_parallel(rec, b, 15, 1, 0)
