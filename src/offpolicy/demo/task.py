"""The demo's verifiable task: sort a short list of numbers; reward 1 for the exact sorted answer, else 0.

Sequences are token ids over a vocabulary of ``vocab`` ids (at least ``max_value + 2``):

    BOS x_1 ... x_n SEP y_1 ... y_n          x_i, y_i in [0, max_value)

The prompt is ``BOS x SEP`` (``n + 2`` tokens); the policy writes the ``n`` answer tokens ``y``. Any token may be
sampled at an answer position, so the reward check is exact: ``y == sorted(x)``, elementwise. The two markers and
the ids ``max_value + 2 .. vocab - 1`` never appear in a correct answer: they play the part of a language model's
long vocabulary tail, the rare tokens whose importance ratios are the extreme ones.

Scratchpad variant (``scratch > 0``): the policy first writes ``scratch`` unscored tokens, then the sorted list:

    BOS x_1 ... x_n SEP s_1 ... s_k y_1 ... y_n       s_j any id (unscored), reward from y alone

The supervised warm-up teaches the scratchpad as uniform over the tail ids (``max_value + 2 .. vocab - 1``), so
the tail carries real probability at unscored positions: a rare scratch token inside a successful answer is
reinforced, never punished by the reward, and the numerics mismatch alone can bias uncorrected GRPO there.

Held-out split: a prompt belongs to the evaluation set iff a fixed hash of its numbers is ``0 mod heldout_mod``;
training prompts are drawn from the complement, so the held-out pass@k is measured on prompts never trained on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SortTask:
    """Sorting ``n_items`` numbers drawn uniformly from ``[0, max_value)``.

    Attributes:
        n_items: list length ``n`` (the answer length).
        max_value: numbers are ``0 .. max_value - 1``; they are also their own token ids.
        vocab: vocabulary size; the ids past ``max_value + 1`` are never a correct answer (the tail).
        heldout_mod: one prompt in about ``heldout_mod`` is held out for evaluation.
        scratch: unscored scratchpad tokens written before the answer (0: none, the plain task).
    """

    n_items: int = 12
    max_value: int = 32
    vocab: int = 256
    heldout_mod: int = 16
    scratch: int = 0

    def __post_init__(self) -> None:
        if self.n_items < 1:
            raise ValueError(f"n_items must be >= 1, got {self.n_items}")
        if self.max_value < 2:
            raise ValueError(f"max_value must be >= 2, got {self.max_value}")
        if self.vocab < self.max_value + 2:
            raise ValueError(f"vocab must be >= max_value + 2 = {self.max_value + 2}, got {self.vocab}")
        if self.heldout_mod < 2:
            raise ValueError(f"heldout_mod must be >= 2, got {self.heldout_mod}")
        if self.scratch < 0:
            raise ValueError(f"scratch must be >= 0, got {self.scratch}")
        if self.scratch and self.vocab < self.max_value + 3:
            raise ValueError(f"scratch > 0 needs tail ids: vocab must be >= max_value + 3 = {self.max_value + 3}, "
                             f"got {self.vocab}")

    @property
    def sep(self) -> int:
        return self.max_value

    @property
    def bos(self) -> int:
        return self.max_value + 1

    @property
    def vocab_size(self) -> int:
        return self.vocab

    @property
    def prompt_len(self) -> int:
        return self.n_items + 2

    @property
    def tail_start(self) -> int:
        """First id that is never part of a correct answer (the tail: ``tail_start .. vocab - 1``)."""
        return self.max_value + 2

    @property
    def answer_len(self) -> int:
        """Tokens the policy writes: the scratchpad, then the ``n_items`` scored ones."""
        return self.scratch + self.n_items

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.answer_len

    def is_heldout(self, numbers: Tensor) -> Tensor:
        """``[B]`` bool: whether each list of ``numbers [B, n]`` belongs to the evaluation set."""
        # A fixed polynomial hash of the list in int64, reduced modulo a prime after every item (never overflows);
        # the multiplier keeps it from depending on the sum alone, so sorted-equal lists are not all grouped.
        h = torch.zeros(numbers.shape[0], dtype=torch.int64, device=numbers.device)
        for i in range(numbers.shape[1]):
            h = (h * 1_000_003 + numbers[:, i].to(torch.int64) * 7919 + i) % 2_147_483_647
        return h % self.heldout_mod == 0

    def sample_numbers(self, batch: int, generator: torch.Generator, heldout: bool = False) -> Tensor:
        """``[batch, n]`` int64 lists from the training split (or the held-out split), by rejection."""
        if batch < 0:
            raise ValueError(f"batch must be >= 0, got {batch}")
        out: list[Tensor] = []
        have = 0
        while have < batch:
            # Oversample: about 1/heldout_mod of draws land in the held-out split.
            draw = torch.randint(0, self.max_value, (2 * batch + 8 * self.heldout_mod, self.n_items),
                                 generator=generator)
            keep = draw[self.is_heldout(draw) == heldout]
            out.append(keep)
            have += keep.shape[0]
        return torch.cat(out)[:batch]

    def prompts(self, numbers: Tensor) -> Tensor:
        """``[B, n + 2]`` prompt ids ``BOS x SEP`` for ``numbers [B, n]``."""
        self._check_numbers(numbers, "numbers")
        b = numbers.shape[0]
        bos = torch.full((b, 1), self.bos, dtype=torch.int64)
        sep = torch.full((b, 1), self.sep, dtype=torch.int64)
        return torch.cat([bos, numbers.to(torch.int64), sep], dim=1)

    def answers(self, numbers: Tensor) -> Tensor:
        """``[B, n]`` the correct answers: ``numbers`` sorted ascending."""
        self._check_numbers(numbers, "numbers")
        return torch.sort(numbers.to(torch.int64), dim=1).values

    def targets(self, numbers: Tensor, generator: torch.Generator) -> Tensor:
        """``[B, answer_len]`` supervised targets: a scratchpad of uniform tail ids (from ``generator``), then the
        sorted numbers."""
        sorted_ = self.answers(numbers)
        if not self.scratch:
            return sorted_
        pad = torch.randint(self.tail_start, self.vocab, (numbers.shape[0], self.scratch), generator=generator)
        return torch.cat([pad, sorted_], dim=1)

    def reward(self, prompts: Tensor, responses: Tensor) -> Tensor:
        """``[B]`` float32 binary reward: 1 iff the scored part of ``responses [B, answer_len]`` (after the
        scratchpad) is exactly the sorted prompt numbers.

        Args:
            prompts: ``[B, n + 2]`` ids as built by :meth:`prompts`.
            responses: ``[B, answer_len]`` sampled answer ids (any vocabulary ids).
        """
        if prompts.dim() != 2 or prompts.shape[1] != self.prompt_len:
            raise ValueError(f"prompts must be [B, {self.prompt_len}], got {tuple(prompts.shape)}")
        if responses.dim() != 2 or responses.shape != (prompts.shape[0], self.answer_len):
            raise ValueError(
                f"responses must be [{prompts.shape[0]}, {self.answer_len}], got {tuple(responses.shape)}"
            )
        if bool((prompts[:, 0] != self.bos).any()) or bool((prompts[:, -1] != self.sep).any()):
            raise ValueError("prompts must start with BOS and end with SEP (build them with SortTask.prompts)")
        target = self.answers(prompts[:, 1:-1])
        return (responses[:, self.scratch:].to(torch.int64) == target).all(dim=1).to(torch.float32)

    def _check_numbers(self, numbers: Tensor, name: str) -> None:
        if numbers.dim() != 2 or numbers.shape[1] != self.n_items:
            raise ValueError(f"{name} must be [B, {self.n_items}], got {tuple(numbers.shape)}")
        if numbers.numel() and (int(numbers.min()) < 0 or int(numbers.max()) >= self.max_value):
            raise ValueError(f"{name} must lie in [0, {self.max_value}), got values in "
                             f"[{int(numbers.min())}, {int(numbers.max())}]")
