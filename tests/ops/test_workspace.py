"""The reused CPU gradient buffer: reused only when nobody holds the previous gradient, never aliasing a tensor a
caller can see; gradients with reuse equal those without; a retained graph's second backward stays correct."""

from __future__ import annotations

import pytest
import torch

from offpolicy.ops import sparse_log_softmax, workspace

from support.vocab_reference import distinct_ids


def _call(leaf, y, c, support=False):
    out = sparse_log_softmax(leaf, y, c, 0.8, support=support)
    return out.target.sum() + torch.where(c >= 0, out.candidates, 0.0).sum()


@pytest.fixture(autouse=True)
def _fresh_workspace():
    workspace.release()
    yield
    workspace.release()


def _inputs(dtype=torch.float32):
    gen = torch.Generator().manual_seed(2)
    z = torch.randn(7, 90, generator=gen).to(dtype)
    y = torch.randint(0, 90, (7,), generator=gen)
    c = distinct_ids(7, 90, 5, gen, pad_frac=0.2)
    return z, y, c


def test_buffer_reused_only_after_release():
    like = torch.empty(4, 10)
    a = workspace.gradient_buffer(like)
    b = workspace.gradient_buffer(like)  # a is still held: a new buffer
    assert a.data_ptr() != b.data_ptr()
    ptr = b.data_ptr()
    del a, b
    c = workspace.gradient_buffer(like)  # the kept (latest) storage is free again
    assert c.data_ptr() == ptr
    view = c[1:]
    del c
    d = workspace.gradient_buffer(like)  # a view still holds the storage
    assert d.data_ptr() != view.data_ptr() - 10 * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("support", [False, True])
def test_reuse_gives_the_same_gradients(monkeypatch, dtype, support):
    z, y, c = _inputs(dtype)
    grads = {}
    for reuse in ("0", "1"):
        monkeypatch.setenv(workspace.ENV_VAR, reuse)
        leaf = z.clone().requires_grad_()
        got = []
        for _ in range(3):  # the second and third calls reuse the first call's buffer (when enabled)
            leaf.grad = None
            _call(leaf, y, c, support).backward()
            got.append(leaf.grad.clone())
        grads[reuse] = got
    for a, b in zip(grads["0"], grads["1"]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_held_gradient_is_never_overwritten():
    z, y, c = _inputs()
    leaf = z.clone().requires_grad_()
    _call(leaf, y, c).backward()
    held = leaf.grad
    snapshot = held.clone()
    other = z.flip(1).clone().requires_grad_()
    _call(other, y, c).backward()  # the first gradient is still referenced: a new buffer
    assert other.grad.data_ptr() != held.data_ptr()
    torch.testing.assert_close(held, snapshot, rtol=0, atol=0)


def test_second_backward_through_retained_graph():
    z, y, c = _inputs()
    leaf = z.clone().requires_grad_()
    loss = _call(leaf, y, c)
    loss.backward(retain_graph=True)
    first = leaf.grad
    leaf.grad = None
    loss.backward()
    assert leaf.grad.data_ptr() != first.data_ptr()
    torch.testing.assert_close(leaf.grad, first, rtol=1e-6, atol=1e-7)
