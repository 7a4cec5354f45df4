"""A seeded fuzz of CSR candidate records (issue 40): offsets, ids, lengths, dtypes and devices (meta included),
each case a batch with at most one broken field, run through every entry that reads a record's indices.

Every outcome must be a clear error (``ValueError`` / ``TypeError``) or a right answer: the loss equal to the
float64 reference (:func:`offpolicy.reference.reference_policy_loss`, fed the padded record) and to the padded
path. ``validate=False`` on a broken record may give any value or error (the caller vouched for the input) but
must not touch memory out of bounds: the AddressSanitizer run (``tools/fuzz_csr_asan.py``) checks that. Shared by
``tests/fuzz/test_fuzz_csr.py`` (a few hundred cases, seconds) and the tool (thousands, under the sanitizer).
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field

import torch

import offpolicy as op
from offpolicy.reference import reference_policy_loss

CLEAR = (ValueError, TypeError)
#: Breakages and whether the loss (``validate=True``) must refuse the batch: True, or False where the breakage sits
#: where validation tolerates it (an untrained row's placeholder values).
BREAKS = {
    None: False,
    "offsets_up_and_down": True, "offsets_first": True, "offsets_last": True, "offsets_rows": True,
    "offsets_mutated_after": True, "offsets_float": True,
    "ids_negative": True, "ids_too_big": True, "ids_huge": True, "ids_duplicate": True, "ids_float": True,
    "lp_nan": True, "lp_posinf": True, "lp_positive_trained": True, "lp_positive_untrained": False,
    "support_not_renormalised": True, "token_outside_support": True, "empty_trained_support_row": True,
    "ids_mutated_after": True, "device_mismatch": True, "meta": True,
}
CORRECTIONS = [
    op.Correction(),
    op.Correction(weights="tis", score_centering=True),
    op.Correction(weights="mis", bounds=(0.5, 2.0)),
    op.Correction(weights="reject", score_centering=True),
]


@dataclass
class Case:
    """One batch and the break applied to its record."""

    seed: int
    n: int
    v: int
    kind: str
    brk: str | None
    z: torch.Tensor
    y: torch.Tensor
    lq: torch.Tensor
    adv: torch.Tensor
    mask: torch.Tensor
    tau: float
    corr: op.Correction
    fields: dict = field(default_factory=dict)  # ids, offsets, logprobs, kind (as passed to the constructor)
    after: tuple | None = None  # (attribute, position, value) written in place after construction


#: The breaks a compiled case takes: those that keep every shape and dtype (one compiled graph serves them all).
SAME_SHAPE_BREAKS = (None, "offsets_up_and_down", "offsets_first", "offsets_last", "ids_negative", "ids_too_big",
                     "ids_huge", "ids_duplicate", "lp_nan", "lp_posinf", "lp_positive_trained",
                     "support_not_renormalised", "token_outside_support")


def make_case(seed: int, fixed: str | None = None) -> Case:
    """The seeded batch: ``N`` in 0..9 rows, ``V`` in 1..64, rows of 0..6 ids, head (the sampler's top ids,
    full-vocabulary log-probabilities) or support (a random support holding the sampled token, renormalised), ids
    and offsets int32 or int64, log-probabilities fp32, fp64 or bf16, logits fp32 or fp64; then one break.

    ``fixed`` (``"head"`` or ``"support"``): the compiled subset's shape instead, ``N = 6``, ``V = 20``, two ids per
    row, int64 ids and offsets, fp32 everything, temperature 1 and one correction, and only the breaks of
    :data:`SAME_SHAPE_BREAKS`."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    # One case in three is unbroken (any shape, empty batches and V = 1 included); the others take every break in
    # turn, on a shape that allows it: at least two non-empty rows, V >= 5.
    if fixed is not None:
        brk = SAME_SHAPE_BREAKS[seed % len(SAME_SHAPE_BREAKS)]
        if fixed == "head" and brk in ("support_not_renormalised", "token_outside_support"):
            brk = None
    else:
        brk = None if seed % 3 == 0 else list(BREAKS)[1 + (seed // 3) % (len(BREAKS) - 1)]
    n = rng.choice([0, 1, 2, 3, 5, 9] if brk is None else [2, 3, 5, 9])
    v = rng.choice([1, 2, 5, 17, 64] if brk is None else [5, 17, 64])
    kind = {"lp_positive_untrained": "head", "support_not_renormalised": "support", "token_outside_support": "support",
            "empty_trained_support_row": "support"}.get(brk, rng.choice(["head", "support"]))
    id_dt, off_dt = rng.choice([torch.int32, torch.int64]), rng.choice([torch.int32, torch.int64])
    if brk == "ids_huge":
        id_dt = torch.int64
    lp_dt = rng.choice([torch.float32, torch.float64, torch.bfloat16])
    z_dt = rng.choice([torch.float32, torch.float64])
    if fixed is not None:
        n, v, kind, id_dt, off_dt, lp_dt, z_dt = 6, 20, fixed, torch.int64, torch.int64, torch.float32, torch.float32
    z = (torch.randn(n, v, generator=gen, dtype=torch.float64) * 2)
    q = torch.softmax(z + torch.randn(n, v, generator=gen, dtype=torch.float64), dim=1)
    ids, lps, lengths = [], [], []
    y = torch.zeros(n, dtype=torch.int64)
    lq = torch.zeros(n, dtype=torch.float64)
    for t in range(n):
        k = rng.randint(0 if kind == "head" and brk is None else 1, min(v, 6))
        if kind == "support" and (rng.random() < 0.15 and t > 1 or brk == "empty_trained_support_row" and t == 1):
            k = 0  # an empty (untrained) support row
        if t == 0 and brk is not None:
            k = max(k, 2)  # room for a duplicate, a broken sum, a token outside its support
        if fixed is not None:
            k = 2
        if kind == "head":
            y[t] = torch.multinomial(q[t], 1, generator=gen)[0]
            lq[t] = torch.log(q[t, y[t]])
            top = torch.topk(q[t], k)
            row_ids, row_lp = top.indices, torch.log(top.values)
        else:
            s = torch.randperm(v, generator=gen)[:max(k, 1)]
            ps = q[t, s] / q[t, s].sum()
            pick = torch.multinomial(ps, 1, generator=gen)[0]
            y[t], lq[t] = s[pick], torch.log(ps[pick])
            row_ids, row_lp = s[:k], torch.log(ps)[:k]
        ids.append(row_ids)
        lps.append(row_lp)
        lengths.append(k)
    cat_ids = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int64)
    cat_lp = torch.cat(lps) if lps else torch.zeros(0, dtype=torch.float64)
    offsets = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)
    lengths_t = torch.tensor(lengths, dtype=torch.int64)
    if kind == "support":
        mask = lengths_t > 0
    else:
        mask = torch.rand(n, generator=gen) > 0.2
        if n:
            mask[0] = True
        if fixed is not None:
            mask = torch.tensor([True, True, False, True, True, True])
        if brk == "lp_positive_untrained":
            mask[1] = False
    if lp_dt == torch.bfloat16 and kind == "support":
        lp_dt = torch.float32  # a bf16 support row's sum is checked against bf16's rounding; kept to fp32 here
    tau, corr = rng.choice([1.0, 0.7, 1.3]), rng.choice(CORRECTIONS)
    if fixed is not None:
        tau, corr = 1.0, CORRECTIONS[1]
    case = Case(seed, n, v, kind, None, z.to(z_dt), y, lq.float(), torch.randn(n, generator=gen), mask, tau, corr)
    case.fields = dict(ids=cat_ids.to(id_dt), offsets=offsets.to(off_dt), logprobs=cat_lp.to(lp_dt), kind=kind)
    if brk is not None:
        _break(case, rng, lengths_t, brk)
    return case


def _break(case: Case, rng: random.Random, lengths: torch.Tensor, preferred: str) -> None:
    """Apply ``preferred``, or where the case's shape does not allow it, another break at random."""
    f = case.fields
    ids, off, lp = f["ids"].clone(), f["offsets"].clone(), f["logprobs"].clone()
    n, nnz = case.n, ids.numel()
    row_of = torch.repeat_interleave(torch.arange(n), lengths) if n else torch.zeros(0, dtype=torch.int64)
    trained_entries = [j for j in range(nnz) if bool(case.mask[row_of[j]])]
    untrained_entries = [j for j in range(nnz) if not bool(case.mask[row_of[j]])]
    big = 2**40 if off.dtype == torch.int64 else 2**31 - 1
    options = ["offsets_first", "offsets_last", "offsets_rows", "offsets_float", "ids_float", "meta"]
    if n >= 2:
        options += ["offsets_up_and_down", "offsets_mutated_after"]
    if nnz:
        options += ["ids_negative", "ids_too_big", "lp_nan", "lp_posinf", "ids_mutated_after", "device_mismatch"]
        if ids.dtype == torch.int64:
            options.append("ids_huge")
    if any(int(x) >= 2 for x in lengths):
        options.append("ids_duplicate")
    if trained_entries:
        options.append("lp_positive_trained")
    if untrained_entries:
        options.append("lp_positive_untrained")
    trained_support = [t for t in range(n) if case.kind == "support" and bool(case.mask[t]) and int(lengths[t]) >= 2]
    if trained_support:
        options += ["support_not_renormalised", "token_outside_support"]
    if case.kind == "support" and any(int(lengths[t]) == 0 for t in range(n)):
        options.append("empty_trained_support_row")
    if preferred not in options and preferred in SAME_SHAPE_BREAKS:
        return  # a compiled case whose shape does not allow its break stays unbroken
    brk = preferred if preferred in options else rng.choice(options)
    case.brk = brk
    if brk == "offsets_up_and_down":
        off[rng.randint(1, n - 1)] = rng.choice([big, -3, nnz + 7])
    elif brk == "offsets_first":
        off[0] = rng.choice([1, -1, big])
    elif brk == "offsets_last":
        off[-1] = rng.choice([nnz + 1, big, max(nnz - 1, -1)])
        if int(off[-1]) == nnz:
            off[-1] = nnz + 1
    elif brk == "offsets_rows":
        off = torch.cat([off, off[-1:]]) if rng.random() < 0.5 or n == 0 else off[:-1]
        if off.numel() == 0 or int(off[-1]) != nnz:
            off = torch.cat([f["offsets"], f["offsets"][-1:]])  # one row too many (an empty one): N + 2 offsets
    elif brk == "offsets_float":
        off = off.float()
    elif brk == "offsets_mutated_after":
        case.after = ("offsets", rng.randint(1, n - 1), rng.choice([big, -3]))
    elif brk == "ids_negative":
        ids[rng.randrange(nnz)] = rng.choice([-1, -5])
    elif brk == "ids_too_big":
        ids[rng.randrange(nnz)] = case.v + rng.choice([0, 3])
    elif brk == "ids_huge":
        ids[rng.randrange(nnz)] = 2**40
    elif brk == "ids_duplicate":
        t = rng.choice([t for t in range(n) if int(lengths[t]) >= 2])
        ids[int(off[t]) + 1] = ids[int(off[t])]
    elif brk == "ids_float":
        ids = ids.float()
    elif brk == "ids_mutated_after":
        case.after = ("ids", rng.randrange(nnz), rng.choice([-5, case.v + 3]))
    elif brk == "lp_nan":
        lp[rng.randrange(nnz)] = float("nan")
    elif brk == "lp_posinf":
        lp[rng.randrange(nnz)] = float("inf")
    elif brk == "lp_positive_trained":
        lp[rng.choice(trained_entries)] = 0.5
    elif brk == "lp_positive_untrained":
        lp[rng.choice(untrained_entries)] = 0.5
    elif brk == "support_not_renormalised":
        t = rng.choice(trained_support)
        lp[int(off[t]):int(off[t + 1])] -= 0.7
    elif brk == "token_outside_support":
        t = rng.choice(trained_support)
        row = ids[int(off[t]):int(off[t + 1])]
        outside = [x for x in range(case.v) if x not in row.tolist()]
        if outside:
            case.y = case.y.clone()
            case.y[t] = outside[0]
        else:  # the support is the whole vocabulary: break the sum instead
            lp[int(off[t]):int(off[t + 1])] -= 0.7
    elif brk == "empty_trained_support_row":
        t = rng.choice([t for t in range(n) if int(lengths[t]) == 0])
        case.mask = case.mask.clone()
        case.mask[t] = True
    elif brk == "device_mismatch":
        lp = lp.to("meta")
    case.fields = dict(ids=ids, offsets=off, logprobs=lp, kind=f["kind"])


@dataclass
class Outcome:
    """What one case did, path by path: ``value``, ``error:<Type>`` or ``bad:<why>`` (a failure)."""

    seed: int
    brk: str | None
    paths: dict = field(default_factory=dict)

    @property
    def failures(self) -> list[str]:
        return [f"{p}: {o}" for p, o in self.paths.items() if o.startswith("bad:")]


def _try(fn):
    try:
        return "value", fn()
    except CLEAR as e:
        return f"error:{type(e).__name__}", e
    except Exception as e:  # noqa: BLE001 - classified as a failure by the caller
        return f"bad:{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}", e


def _close(a: float, b: float, rtol: float) -> bool:
    return math.isfinite(a) and abs(a - b) <= rtol * max(1.0, abs(b))


def run_case(case: Case, *, compiled=None) -> Outcome:
    """Run every path on the case and classify each; ``compiled`` (a compiled ``(z, y, lq, adv, mask, ids,
    offsets, logprobs) -> loss`` function that builds the record of the case's kind and calls ``op.policy_loss``
    with the case's temperature and correction, see :func:`compiled_loss`) adds the compiled call."""
    out = Outcome(case.seed, case.brk)
    must_refuse = BREAKS[case.brk]
    f = dict(case.fields)
    if case.brk == "meta":
        f = {k: (x.to("meta") if isinstance(x, torch.Tensor) else x) for k, x in f.items()}
    status, rec = _try(lambda: op.CSRCandidates(**f))
    out.paths["construct"] = status
    if status.startswith("bad:"):
        return out
    if status != "value":
        if not must_refuse:
            out.paths["construct"] = f"bad:refused a good record ({rec})"
        return out
    if case.after is not None:
        name, pos, val = case.after
        getattr(rec, name)[pos] = val
    meta = rec.ids.device.type == "meta" or rec.logprobs.device.type == "meta"
    # Index helpers: values or clear errors, never out of bounds (a crash ends the process).
    if not meta:
        status, row = _try(rec.row_index)
        if status == "value" and row.numel() and not (0 <= int(row.min()) and int(row.max()) < max(rec.num_rows, 1)):
            status = "bad:row_index out of [0, N)"
        out.paths["row_index"] = status
        lo, hi = (-1, rec.num_rows + 1) if case.seed % 3 == 0 else (0, max(rec.num_rows, 1))
        idx = torch.randint(lo, hi, (3,), generator=torch.Generator().manual_seed(case.seed))
        out.paths["take_rows"] = _try(lambda: rec.take_rows(idx))[0]
        out.paths["cat"] = _try(lambda: op.CSRCandidates.cat([rec, rec]))[0]
    z = case.z.to("meta") if case.brk == "meta" else case.z
    y, lq, adv, mask = (x.to(z.device) for x in (case.y, case.lq, case.adv, case.mask))

    def loss(record, validate=True):
        leaf = z.clone().requires_grad_()
        res = op.policy_loss(leaf, y, lq, adv, record, mask, case.tau, case.corr, validate=validate)
        res.loss.backward()
        return res, leaf.grad

    status, res = _try(lambda: loss(rec))
    if status == "value" and must_refuse:
        status = "bad:accepted a broken record"
    elif status.startswith("error") and not must_refuse:
        status = f"bad:refused a good record ({res})"
    elif status == "value":
        status = _compare(case, rec, *res)
    out.paths["policy_loss"] = status
    if not meta:
        # The caller vouches for the input: any value or error, but never memory out of bounds.
        s = _try(lambda: loss(rec, validate=False))[0]
        out.paths["policy_loss validate=False"] = "value" if s == "value" else "error:any"
    if compiled is not None and not meta:
        status, res = _try(lambda: compiled(z, y, lq, adv, mask, rec.ids, rec.offsets, rec.logprobs))
        if status == "value" and must_refuse:
            status = "bad:compiled accepted a broken record"
        elif status.startswith("error") and not must_refuse:
            status = f"bad:compiled refused a good record ({res})"
        elif status == "value":
            want = float(loss(rec)[0].loss)
            status = "value" if _close(float(res), want, 1e-5) else f"bad:compiled {float(res)} != eager {want}"
        out.paths["compiled"] = status
    return out


def compiled_loss(kind: str, tau: float = 1.0, corr: op.Correction = CORRECTIONS[1]):
    """``torch.compile`` (default arguments) of the loss of a record of ``kind`` built inside the graph."""

    def loss(z, y, lq, adv, mask, ids, offsets, logprobs):
        rec = op.CSRCandidates(ids, offsets, logprobs, kind)
        return op.policy_loss(z, y, lq, adv, rec, mask, tau, corr).loss

    return torch.compile(loss)


def _compare(case: Case, rec, res, grad) -> str:
    """The loss and gradient against the float64 reference and the padded path."""
    pad = rec.to_padded()
    z64 = case.z.double().clone().requires_grad_()
    ref, _, _ = reference_policy_loss(z64, case.y, case.lq, case.adv, pad, case.mask, case.tau, case.corr)
    ref.backward()
    rtol = 1e-9 if case.z.dtype == torch.float64 else 2e-4
    got = float(res.loss)
    if not _close(got, float(ref), rtol):
        return f"bad:loss {got} != reference {float(ref)}"
    scale = float(z64.grad.abs().max()) if z64.grad.numel() else 0.0
    if grad.numel() and float((grad.double() - z64.grad).abs().max()) > rtol * max(1.0, scale) * 10:
        return "bad:gradient off the reference"
    leaf = case.z.clone().requires_grad_()
    padded = op.policy_loss(leaf, case.y, case.lq, case.adv, pad, case.mask, case.tau, case.corr)
    if not _close(got, float(padded.loss), rtol):
        return f"bad:loss {got} != padded {float(padded.loss)}"
    return "value"


def summarise(outcomes: list[Outcome]) -> dict:
    """Counts per break and path outcome, and the failures."""
    per_path = Counter()
    per_break = Counter()
    for o in outcomes:
        per_break[str(o.brk)] += 1
        for p, s in o.paths.items():
            per_path[f"{p} -> {s.split(' (')[0] if not s.startswith('bad:') else 'FAILED'}"] += 1
    failures = [f"seed {o.seed} ({o.brk}): {msg}" for o in outcomes for msg in o.failures]
    return {"cases": len(outcomes), "breaks": dict(sorted(per_break.items())),
            "paths": dict(sorted(per_path.items())), "failures": failures}
