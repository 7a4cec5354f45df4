"""The planted attribution example of docs/diagnose.md#attribution: a toy-MoE fleet (tests/support/toy_moe.py) with a
stale group, an NVFP4 group, a group whose engine flips routes, a mis-read record (raw log-probs), a stale NVFP4
group with flipped routes, and an honest group; attributed with routing replay. Three "training steps" with the
stale groups 1, 2 and 4 versions behind give the history plot.

    .venv/bin/python tools/attribution_example.py            # writes docs/attribution_example/

Writes attribution.md, attribution.json, attribution.png and attribution_history.png (the last step's report, the
earlier steps as its history). Seeded; the timings are the machine's (one thread).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from offpolicy.diagnose.attribution import attribute  # noqa: E402
from support.toy_moe import ToyMoE, fleet_records, make_replay, perturbed  # noqa: E402

CURRENT = 8


def groups(behind: int) -> list[dict]:
    stale = CURRENT - behind
    return [
        dict(name="a100-bf16", format="bf16", version=CURRENT),
        dict(name="h100-stale", format="fp32", version=stale),
        dict(name="b200-nvfp4", format="nvfp4", version=CURRENT),
        dict(name="h200-flips", format="fp32", version=CURRENT, flip=0.3),
        dict(name="rtx-raw-logprobs", format="fp32", version=CURRENT, raw=True),
        dict(name="b300-stale-nvfp4-flips", format="nvfp4", version=stale, flip=0.3),
    ]


def main() -> None:
    torch.set_num_threads(1)
    out = ROOT / "docs" / "attribution_example"
    trainer = ToyMoE(seed=0)
    # version CURRENT - k: k training steps of 2.5% relative noise each, applied backwards from the trainer
    weights, net = {}, trainer
    for k in range(1, 5):
        net = perturbed(net, 0.025, seed=100 + k)
        weights[CURRENT - k] = net
    history = []
    for step, behind in ((100, 1), (200, 2), (300, 4)):
        gs = groups(behind)
        rec, routes = fleet_records(trainer, weights, gs, current=CURRENT, seqs=24, new=8, seed=step)
        rep = attribute(rec, model=trainer, current_version=CURRENT, weights=weights,
                        formats={g["name"]: g["format"] for g in gs}, replay=make_replay(rec, routes), step=step)
        if step < 300:
            history.append(rep.as_dict())
    rep.save(out, history=history)
    rep.print()
    # order dependence, for the docs: the stale NVFP4 group's staleness share of mean |log r| measured first (from
    # the trainer's own configuration) and last (after format, routing and the residual), against its Shapley share
    g = rec.group_names.index("b300-stale-nvfp4-flips")
    sel = (rec.group_index[rep.token_index] == g).nonzero().flatten()
    c, res = rep.coalitions[sel], rep.residual[sel]
    total = (c[:, 7] + res).abs().mean()
    first = float(c[:, 1].abs().mean() / total)
    last = float(((c[:, 7] + res).abs().mean() - (c[:, 6] + res).abs().mean()) / total)
    shapley = rep.slice("group", "b300-stale-nvfp4-flips").parts["staleness"]["share_mean_abs_log_r"]
    print(f"\nb300-stale-nvfp4-flips staleness share: first {first:.2f}, last {last:.2f}, Shapley {shapley:.2f}")


if __name__ == "__main__":
    main()
