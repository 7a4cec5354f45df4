"""The one backend registry of both primitives: choice by argument, environment and device; capabilities instead
of names; clear errors."""

from __future__ import annotations

import pytest
import torch

from offpolicy.ops import backend_registry, cpu_native, linear_sparse_log_softmax, sparse_log_softmax


def test_every_backend_implements_both_contracts():
    for backend in backend_registry.BACKENDS.values():
        for name in ("full_stats", "full_grad"):
            assert callable(getattr(backend.logits, name)), (backend.name, name)
        for name in ("gathered_logits", "full_stats", "backward"):
            assert callable(getattr(backend.linear, name)), (backend.name, name)
        if backend.caches_probs:
            assert callable(backend.logits.grad_from_probs)


def test_choice_order(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv(backend_registry.ENV_VAR, raising=False)
    native = cpu_native.load() is not None  # a C compiler builds the kernels (it does on the CI machines)
    assert backend_registry.choose(None, cpu, torch.float32).name == ("cpu" if native else "torch")
    assert backend_registry.choose(None, torch.device("cuda"), torch.float32).name == "triton"
    monkeypatch.setenv(cpu_native.ENV_VAR, "0")
    assert backend_registry.choose(None, cpu, torch.float32).name == "torch"
    monkeypatch.delenv(cpu_native.ENV_VAR)
    monkeypatch.setenv(backend_registry.ENV_VAR, "triton")
    assert backend_registry.choose(None, cpu, torch.float32).name == "triton"
    assert backend_registry.choose("torch", cpu, torch.float32).name == "torch"  # the argument wins


def test_float64_goes_to_a_float64_backend():
    chosen = backend_registry.choose("triton", torch.device("cpu"), torch.float64)
    assert chosen.float64 and chosen.name == "torch"


def test_unknown_backend_is_named(monkeypatch):
    with pytest.raises(ValueError, match="'cuda' is not a backend"):
        backend_registry.choose("cuda", torch.device("cpu"), torch.float32)
    monkeypatch.setenv(backend_registry.ENV_VAR, "nope")
    with pytest.raises(ValueError, match=r"\$OFFPOLICY_BACKEND='nope'"):
        sparse_log_softmax(torch.zeros(2, 3), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="not registered"):
        backend_registry.get("nope")


def test_without_a_compiler_the_cpu_default_is_torch(monkeypatch, tmp_path):
    """No C compiler: one RuntimeWarning naming the reason, then the PyTorch backend, which gives the same values."""
    monkeypatch.setattr(cpu_native, "_STATE", {})
    monkeypatch.setenv(cpu_native.CACHE_ENV_VAR, str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.delenv(backend_registry.ENV_VAR, raising=False)
    with pytest.warns(RuntimeWarning, match="'no-such-compiler' is not on PATH"):
        assert backend_registry.choose(None, torch.device("cpu"), torch.bfloat16).name == "torch"
    assert "no-such-compiler" in cpu_native.unavailable_reason()
    with pytest.raises(RuntimeError, match="backend 'cpu': the native CPU kernels are unavailable"):
        sparse_log_softmax(torch.zeros(2, 3), torch.zeros(2, dtype=torch.int64), backend="cpu")
    assert list(tmp_path.iterdir()) == []


def test_cpu_backend_needs_cpu_tensors():
    with pytest.raises(ValueError, match="backend 'cpu' runs C loops on CPU tensors"):
        backend_registry.choose("cpu", torch.device("cuda"), torch.float32)


def test_kernel_backend_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        linear_sparse_log_softmax(torch.zeros(2, 4), torch.zeros(3, 4), torch.zeros(2, dtype=torch.int64),
                                  backend="triton")


def test_cached_probabilities_follow_the_capability(monkeypatch):
    """The forward leaves exp(x - m) for the backward exactly when the backend declares ``caches_probs``: a backend
    record that declares it off makes the torch backend recompute (same gradient)."""
    calls = []
    torch_mod = backend_registry.BACKENDS["torch"].logits
    original = torch_mod.grad_from_probs
    monkeypatch.setattr(torch_mod, "grad_from_probs", lambda *a: calls.append(1) or original(*a))
    z = torch.randn(5, 70)
    y = torch.randint(0, 70, (5,))
    grads = []
    for caches in (True, False):
        monkeypatch.setitem(backend_registry.BACKENDS, "torch", backend_registry.Backend(
            "torch", "offpolicy.ops.logits_op.torch_backend", "offpolicy.ops.linear_op.linear_torch_backend", caches_probs=caches,
            float64=True, needs_kernels=False))
        leaf = z.clone().requires_grad_()
        sparse_log_softmax(leaf, y, backend="torch").target.sum().backward()
        grads.append(leaf.grad)
    assert calls == [1]
    torch.testing.assert_close(grads[0], grads[1])


@pytest.mark.parametrize("support", [False, True])
def test_eager_calls_resolve_the_backend_once_and_skip_the_custom_ops(monkeypatch, support):
    """One path: an eager call (forward and backward, both ops) chooses its backend once, never looks it up again
    by name, and calls it directly; the custom ops of ``offpolicy.ops.library`` are for ``torch.compile`` only."""
    from offpolicy.ops import library  # noqa: PLC0415

    chosen, looked_up = [], []
    choose, get = backend_registry.choose, backend_registry.get
    monkeypatch.setattr(backend_registry, "choose", lambda *a: chosen.append(a[0]) or choose(*a))
    monkeypatch.setattr(backend_registry, "get", lambda *a: looked_up.append(a) or get(*a))
    for name in ("full_stats", "full_grad", "full_grad_inplace_", "linear_gathered_logits", "linear_full_stats",
                 "linear_backward"):
        monkeypatch.setattr(library, name, lambda *a, _n=name: pytest.fail(f"eager call went through {_n}"))
    z = torch.randn(4, 30, requires_grad=True)
    h, w = torch.randn(4, 6, requires_grad=True), torch.randn(30, 6, requires_grad=True)
    y, c = torch.tensor([1, 2, 3, 4]), torch.tensor([[1, 5], [2, 6], [7, -1], [4, 8]])
    for backend in ("torch", "cpu" if cpu_native.load() is not None else "torch"):
        sparse_log_softmax(z, y, c, support=support, backend=backend).target.sum().backward()
        linear_sparse_log_softmax(h, w, y, c, support=support, backend=backend).target.sum().backward()
    assert len(chosen) == 4 and looked_up == []
