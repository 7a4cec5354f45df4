"""Peak bytes of the tensors a block of torch code creates: a test's or benchmark's check of a memory bound.

::

    meter = LiveBytes()
    with meter:
        op.policy_loss(...).loss.backward()
    meter.peak  # bytes, at the worst moment, of the storages the ops made and had not yet freed

A storage counts from the op that made it until it is freed; views, in-place results and the storages of the op's
inputs are not new memory. Dense (strided) tensors only. It sees what torch's dispatcher sees, on any device: a
kernel's scratch allocated outside torch (a Triton kernel's registers, a C loop's stack) is not counted.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """A dispatch mode counting the bytes of the storages created while it is on: ``now`` (still alive) and
    ``peak`` (the largest ``now`` seen)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = 0
        self.peak = 0

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                if isinstance(t, torch.Tensor) and t.layout == torch.strided}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in seen and key not in self.live:
                    self.live[key] = storage.nbytes()
                    self.now += storage.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(storage, self._free, key)
        return out
