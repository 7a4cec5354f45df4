"""Print `offpolicy diagnose` summaries for a right record and each planted mistake (docs/diagnose.md quotes them).

    .venv/bin/python tools/diagnose_examples.py

Records come from the reference sampler (`offpolicy.fleet.sampler.sample`, vLLM filter semantics, seeded) on a
random bigram model over 48 tokens; the trainer is the same model, so every divergence comes from the mistake.
The live-engine versions of the same mistakes are tests/adapters/test_vllm_live.py.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from offpolicy import Candidates
from offpolicy.diagnose import diagnose, from_token_batch
from offpolicy.fleet.sampler import sample

V = 48


class Bigram(torch.nn.Module):
    """``logits[b, l] = E[ids[b, l]]`` ``[B, L, V]``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Parameter(torch.randn(V, V, generator=torch.Generator().manual_seed(0)) * 2.5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb[ids]


def rollouts(model, temperature, top_p=1.0, kind="head", declared=None):
    prompts = torch.randint(0, V, (32, 3), generator=torch.Generator().manual_seed(1))
    ro = sample(model, prompts, 6, temperature, top_p, None, record=kind, k=6, filter_semantics="vllm",
                generator=torch.Generator().manual_seed(2))
    rec = from_token_batch(ro.flatten(), ro.sequences, top_p=top_p)
    return rec if declared is None else replace(rec, temperature=torch.full_like(rec.temperature, declared))


def unrenormalised(rec, model):
    with torch.no_grad():
        lt = torch.log_softmax(model(rec.sequences)[rec.rows, rec.cols - 1].double() / rec.temperature[:, None], -1)
    ids = rec.candidates.to_padded().ids
    lps = torch.where(ids >= 0, lt.gather(1, ids.clamp(min=0)), float("-inf")).float()
    return replace(rec, sampler_logprobs=lt.gather(1, rec.tokens[:, None])[:, 0].float(),
                   candidates=Candidates(ids, lps, "support"))


def main() -> None:
    model = Bigram()
    cases = {
        "right (support, T = 0.7, top-p 0.9)": rollouts(model, 0.7, 0.9, "support"),
        "raw log-probs (sampled at T = 1, declared 0.7)": rollouts(model, 1.0, declared=0.7),
        "temperature twice (sampled at 0.49, declared 0.7)": rollouts(model, 0.49, declared=0.7),
        "top-p 0.9 without renormalisation": unrenormalised(rollouts(model, 0.7, 0.9, "support"), model),
    }
    for title, rec in cases.items():
        print(f"### {title}\n")
        print(diagnose(rec, model=model).text())
        print()


if __name__ == "__main__":
    main()
