"""The fused-linear op's contract on every registered backend: :func:`offpolicy.ops.linear_sparse_log_softmax`
against its float64 reference :func:`offpolicy.ops.linear_op.linear_naive.linear_sparse_log_softmax`, outputs and
the gradients of ``hidden``, ``weight`` and ``bias`` (``support.linear_reference.check_against_reference``).

Without a GPU the ``triton`` backend runs in Triton's interpreter (conftest.py) on fp32 and fp16 only: the
interpreter's bf16 ``tl.dot`` is wrong, so bf16 is checked there on a GPU. Shapes are small (the interpreter costs
milliseconds per program). Tolerances per dtype (``linear_reference.TOL``, derived in
``tests/ops/test_linear_log_softmax.py``): values within ``2e-5 (1 + max|x|)`` for fp32 and fp16 inputs and
``2^-7 (1 + max|x|)`` for bf16; gradients within ``1e-4`` (fp32), ``1e-3`` (fp16), ``2e-2`` (bf16) of their largest
entry.
"""

from __future__ import annotations

import pytest
import torch
from support.linear_reference import check_against_reference, leaves, make_inputs

from offpolicy.ops import backend_registry, linear_sparse_log_softmax

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
BACKENDS = sorted(backend_registry.BACKENDS)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _runs(backend: str, dtype: torch.dtype) -> bool:
    """Whether ``backend`` runs ``dtype`` here: ``cpu`` needs CPU tensors; the interpreter's bf16 is off."""
    if backend == "cpu":
        return DEVICE == "cpu"
    return not (backend == "triton" and dtype == torch.bfloat16 and not CUDA)


def _skip_unless(backend: str, dtype: torch.dtype = torch.float32) -> None:
    if not _runs(backend, dtype):
        pytest.skip(f"{backend} does not run {dtype} here")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("support", [False, True], ids=["full", "support"])
def test_matches_naive(backend, dtype, support):
    """Per-row temperatures, a bias, padded candidates (an empty row, the target among them), two skipped rows;
    37 rows (three Triton token blocks, a partial program group) and, on torch, a small working-set budget."""
    _skip_unless(backend, dtype)
    h, w, b, y, c, tau = make_inputs(n=37, d=40, v=150, k=5, dtype=dtype, seed=7)
    skip = torch.zeros(37, dtype=torch.bool)
    skip[[0, 20]] = True
    check_against_reference(h, w, b, y, c, tau, support=support, skip=skip, chunk_bytes=1 << 14, dtype=dtype,
                            backend=backend, device=DEVICE)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("support", [False, True], ids=["full", "support"])
def test_hostile_values(backend, support):
    """Logits of size ~1e4, temperatures from 0.05 to 10, and a bias of ``-inf`` on a quarter of the vocabulary."""
    _skip_unless(backend)
    h, w, b, y, c, _ = make_inputs(n=19, d=32, v=120, scale=300.0, seed=5)
    tau = torch.linspace(0.05, 10.0, 19)
    b[::4] = -float("inf")
    check_against_reference(h, w, b, y, c, tau, support=support, chunk_bytes=1 << 14, backend=backend, device=DEVICE)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("support", [False, True], ids=["full", "support"])
def test_no_bias_no_candidates_single_row(backend, support):
    """No bias; ``K = 0`` (support mode: an empty support on every row, no mass); a single row with ``V = 1``."""
    _skip_unless(backend)
    h, w, _, y, _, tau = make_inputs(n=9, d=24, v=97, bias=False, seed=2)
    c = torch.empty(9, 0, dtype=torch.int64) if support else None
    out = check_against_reference(h, w, None, y, c, tau, support=support, backend=backend, device=DEVICE)
    assert out.candidates.shape == (9, 0)
    if support:
        with pytest.raises(ValueError, match="candidate_ids is required"):
            linear_sparse_log_softmax(h, w, y, None, tau, support=True, backend=backend)
        assert bool((out.lse == float("inf")).all()) and bool((out.target == -float("inf")).all())
    h1, w1, b1, y1, c1, tau1 = make_inputs(n=1, d=3, v=1, k=1, pad_frac=0.0, seed=4)
    check_against_reference(h1, w1, b1, y1, c1, tau1, support=support, backend=backend, device=DEVICE)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("support", [False, True], ids=["full", "support"])
def test_all_rows_skipped_and_empty_batch(backend, support):
    _skip_unless(backend)
    h, w, b, y, c, tau = make_inputs(n=4, d=8, v=40)
    out = check_against_reference(h, w, b, y, c, tau, support=support, skip=torch.ones(4, dtype=torch.bool),
                                  backend=backend, device=DEVICE)
    assert bool((out.lse == float("inf")).all())
    hl, wl, bl = (x.to(DEVICE) for x in leaves(h[:0], w, b))
    out = linear_sparse_log_softmax(hl, wl, y[:0].to(DEVICE), c[:0].to(DEVICE), tau[:0].to(DEVICE), bias=bl,
                                    support=support, backend=backend)
    assert out.target.shape == (0,) and out.candidates.shape == (0, c.shape[1])
    gh, gw, gb = torch.autograd.grad(out.target.sum() + out.candidates.sum(), [hl, wl, bl], allow_unused=True)
    assert gh.shape == (0, h.shape[1]) and bool((gw == 0).all()) and bool((gb == 0).all())
