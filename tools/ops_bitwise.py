"""Record, or compare against a recording, both primitives' outputs and gradients on many random cases: the check
that a refactoring of ``offpolicy.ops`` changed no bit.

    PYTHONPATH=$PWD/src .venv/bin/python tools/ops_bitwise.py record /tmp/ops_before.pt   # before the change
    PYTHONPATH=$PWD/src .venv/bin/python tools/ops_bitwise.py compare /tmp/ops_before.pt  # after it

Cases: the logits op on the ``torch`` and ``cpu`` backends and the fused-linear op on ``torch`` and ``cpu``, fp32
and bf16 (and float64 on ``torch``), full and support normalisation, skipped rows, per-row temperatures,
``sum_p2``, in-place gradients; random shapes (including a single row and ``K = 0``) and hostile values (large
logits, ``-inf`` entries, fully skipped batches). Every output and gradient must match exactly (``rtol = atol = 0``,
NaN where NaN). Needs the native CPU kernels.
"""

from __future__ import annotations

import sys

import torch

import offpolicy as op
from offpolicy.ops import linear_sparse_log_softmax


def _case(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    pick = lambda *xs: xs[int(torch.randint(len(xs), (1,), generator=gen))]  # noqa: E731
    linear = seed % 3 == 2
    backend = pick("torch", "cpu")
    dtype = pick(torch.float32, torch.bfloat16, *((torch.float64,) if backend == "torch" else ()))
    n = pick(1, 2, 7, 33)
    v = pick(1, 5, 64, 257, 1000)
    k = pick(0, 1, 4) if v > 1 else pick(0, 1)
    support = k > 0 and bool(torch.randint(2, (1,), generator=gen))
    scale = pick(1.0, 8.0, 200.0)
    temp = pick(1.0, 0.7, "tensor")
    return dict(seed=seed, linear=linear, backend=backend, dtype=dtype, n=n, v=v, k=k, support=support, scale=scale,
                temp=temp, skip=pick("none", "some", "all"), sum_p2=bool(seed % 2), ninf=bool(seed % 5 == 0),
                inplace=(not linear) and seed % 7 == 0)


def _inputs(c: dict):
    gen = torch.Generator().manual_seed(1000 + c["seed"])
    n, v, k = c["n"], c["v"], c["k"]
    tokens = torch.randint(0, v, (n,), generator=gen)
    if c["support"]:  # distinct ids per row, the target among them, some padding
        ids = torch.stack([torch.randperm(v, generator=gen)[:k] for _ in range(n)])
        ids[:, 0] = torch.where(torch.rand(n, generator=gen) < 0.7, tokens, ids[:, 0])
        ids = torch.stack([torch.cat([r.unique()[torch.randperm(r.unique().numel(), generator=gen)],
                                      torch.full((k - r.unique().numel(),), -1)]) for r in ids])
        if k > 1:
            ids[0, -1] = -1
    else:
        ids = torch.randint(-1, v, (n, k), generator=gen) if k else None
    temp = (torch.rand(n, generator=gen) + 0.5) if c["temp"] == "tensor" else c["temp"]
    skip = {"none": None, "some": torch.rand(n, generator=gen) < 0.3, "all": torch.ones(n, dtype=torch.bool)}[c["skip"]]
    g = torch.randn(n, 1 + k, generator=gen, dtype=torch.float64)
    return tokens, ids, temp, skip, g


def _run(c: dict) -> list[torch.Tensor]:
    tokens, ids, temp, skip, g = _inputs(c)
    gen = torch.Generator().manual_seed(2000 + c["seed"])
    n, v, dtype = c["n"], c["v"], c["dtype"]
    if c["linear"]:
        d = 12
        h = (torch.randn(n, d, generator=gen, dtype=torch.float64) * c["scale"] ** 0.5).to(dtype).requires_grad_()
        w = torch.randn(v, d, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
        b = torch.randn(v, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
        out = linear_sparse_log_softmax(h, w, tokens, ids, temp, bias=b, support=c["support"], skip=skip,
                                        backend=c["backend"], sum_p2=c["sum_p2"])
        leaves = [h, w, b]
    else:
        z = torch.randn(n, v, generator=gen, dtype=torch.float64) * c["scale"]
        if c["ninf"]:
            z[0, : max(1, v // 2)] = -float("inf")
        z = z.to(dtype).requires_grad_()
        leaf = z
        if c["inplace"]:
            z = z.clone()  # in-place gradients overwrite a non-leaf copy
            z.retain_grad()
        out = op.sparse_log_softmax(z, tokens, ids, temp, support=c["support"], skip=skip, inplace_grad=c["inplace"],
                                    backend=c["backend"], sum_p2=c["sum_p2"])
        leaves = [leaf]
    logp = torch.cat([out.target[:, None], out.candidates], dim=1)
    live = torch.isfinite(logp)
    loss = (torch.where(live, logp, torch.zeros_like(logp)) * g.to(logp.dtype)).sum()
    results = [out.target, out.candidates, out.lse, out.entropy] + ([out.sum_p2] if c["sum_p2"] else [])
    if loss.requires_grad:
        loss.backward()
        results += [x.grad if x.grad is not None else torch.zeros(0) for x in leaves]
    return [r.detach().clone() for r in results]


CASES = 240


def main(mode: str, path: str) -> None:
    got = [_run(_case(seed)) for seed in range(CASES)]
    if mode == "record":
        torch.save(got, path)
        print(f"recorded {len(got)} cases ({sum(len(r) for r in got)} tensors) to {path}")
        return
    want = torch.load(path)
    bad = []
    for seed, (a, b) in enumerate(zip(got, want)):
        try:
            assert len(a) == len(b)
            for x, y in zip(a, b):
                torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)
        except AssertionError as err:
            bad.append((seed, _case(seed), str(err).splitlines()[0]))
    print(f"{len(got) - len(bad)} of {len(got)} cases bit-identical ({sum(len(r) for r in got)} tensors)")
    for item in bad:
        print("DIFFERS", *item)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
