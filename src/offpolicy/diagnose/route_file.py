"""The sampler's recorded routes for ``offpolicy diagnose --attribute --routes FILE``: a mixture-of-experts sampler's
expert ids per forward position of each recorded sequence, replayed in the trainer's forward
(:func:`offpolicy.routing.replay_routes`) for the routing cause of the attribution.

File (safetensors, docs/diagnose.md#routes-file), aligned with the rollouts' contexts (``context_ids [S]`` /
``context_offsets [B + 1]`` of a safetensors rollouts file, or one context per JSONL line / ``seq_id``, in order):

* ``expert_ids [S, L, K]`` uint8 / int16 (any integer dtype is read and range-checked before narrowing): row ``s``
  is the routing of forward position ``s`` of the contexts laid back to back (the position whose input is token
  ``s``; its logits predict token ``s + 1``), ``L`` the model's routed layers in order, ``K`` its top-k;
* ``route_offsets [B + 1]`` int64: sequence ``b`` owns rows ``route_offsets[b] .. route_offsets[b + 1] - 1``; it
  must equal the rollouts' context offsets (one row per context token);
* ``route_valid [S]`` bool, optional: False where the sampler recorded no route (the last position of a sequence,
  which an engine never forwards; padding); those rows hold 0 and the trainer routes them itself;
* metadata ``num_experts``: ``E``, the routed experts per layer (ids lie in ``[0, E)``).

Every check runs where the file is read (:func:`load_routes`) and against the model (:meth:`SequenceRoutes.replay`);
each failure raises :class:`~offpolicy.diagnose.schema.RolloutsError` naming the file and the tensor.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from offpolicy.diagnose.recorded import RecordedRollouts
from offpolicy.diagnose.schema import RolloutsError
from offpolicy.records.routed_experts import RoutedExperts

TENSORS = ("expert_ids", "route_offsets")


@dataclass(frozen=True)
class SequenceRoutes:
    """The sampler's routes of ``B`` sequences: ``record`` (a dense :class:`~offpolicy.records.RoutedExperts` over
    the ``S`` context positions back to back, ``valid`` False where none was recorded) and ``offsets [B + 1]``
    int64 (sequence ``b`` owns rows ``offsets[b] .. offsets[b + 1] - 1``). ``source`` names the file in errors."""

    record: RoutedExperts
    offsets: Tensor
    source: str = "routes"

    def check_model(self, model: nn.Module) -> None:
        """Raise :class:`RolloutsError` naming the file and the tensor unless the model's routed layers take these
        routes (``L`` routed layers, top-``K``, ``E`` experts)."""
        from offpolicy.routing import moe_layers

        try:
            layers = moe_layers(model, "--model")
        except (ValueError, TypeError) as exc:
            raise RolloutsError(f"--routes {self.source}: {exc}; routes replay needs a transformers MoE model") \
                from None
        _, n_layers, k = self.record.ids.shape
        if n_layers != len(layers):
            raise RolloutsError(f"--routes {self.source}, tensor 'expert_ids': L={n_layers} routed layers (dim 1), "
                                f"the model has {len(layers)} (decoder layers {[m.decoder_layer for m in layers]})")
        if {m.router.top_k for m in layers} != {k}:
            raise RolloutsError(f"--routes {self.source}, tensor 'expert_ids': K={k} experts per token-layer (dim 2), "
                                f"the model's routers take top_k={sorted({m.router.top_k for m in layers})}")
        if {m.router.num_experts for m in layers} != {self.record.num_experts}:
            raise RolloutsError(f"--routes {self.source}, metadata 'num_experts': {self.record.num_experts}, the "
                                f"model's routers hold {sorted({m.router.num_experts for m in layers})} experts")

    def batch(self, rows: Tensor, width: int) -> tuple[Tensor, Tensor]:
        """``ids [b, width, L, K]`` int64 and ``pad [b, width]`` bool (True past each sequence's end and where no
        route was recorded) for the sequences ``rows [b]``, right-padded to ``width``."""
        _, n_layers, k = self.record.ids.shape
        ids = torch.zeros(rows.numel(), width, n_layers, k, dtype=torch.int64)
        pad = torch.ones(rows.numel(), width, dtype=torch.bool)
        valid = self.record.token_valid
        for j, b in enumerate(rows.tolist()):
            lo, hi = int(self.offsets[b]), int(self.offsets[b + 1])
            n = min(hi - lo, width)
            ids[j, :n] = self.record.ids[lo: lo + n]
            pad[j, :n] = ~valid[lo: lo + n]
        return ids, pad

    def replay(self, model: nn.Module):
        """The attribution's routing re-scorer (``(model, ScoreBatch) -> logits [b, L, V]``): the batch's forward
        with these routes forced by :func:`offpolicy.routing.replay_routes` (the trainer's router weights over the
        sampler's experts; positions without a route keep the model's own routing). Checks ``model`` first
        (:meth:`check_model`); the copies the attribution makes of it (other versions, quantised) share its
        routers' shape."""
        from offpolicy.routing import replay_routes

        self.check_model(model)

        def rescore(net: nn.Module, batch) -> Tensor:
            ids, pad = self.batch(batch.rows, int(batch.input_ids.shape[1]))
            with replay_routes(net, ids, pad_mask=pad):
                out = net(batch.input_ids)
            return out.logits if hasattr(out, "logits") else out

        return rescore


def save_routes(records: Sequence[RoutedExperts], path: str | Path) -> Path:
    """Write one dense record per recorded sequence, in the rollouts' context order (``T_b`` rows each, row ``t`` =
    forward position ``t``; e.g. :meth:`offpolicy.routing.CapturedRoutes.to_records` of a teacher-forced forward),
    as the routes file :func:`load_routes` reads."""
    from safetensors.torch import save_file

    recs = [r.to_dense() for r in records]
    if not recs:
        raise ValueError("save_routes: records is empty")
    if len({(r.num_experts, r.ids.shape[1:]) for r in recs}) != 1:
        raise ValueError("save_routes: the records must share num_experts, L and K")
    offsets = torch.zeros(len(recs) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor([r.num_tokens for r in recs]).cumsum(0)
    tensors = {"expert_ids": torch.cat([r.ids for r in recs]).contiguous(), "route_offsets": offsets}
    if any(r.valid is not None for r in recs):
        tensors["route_valid"] = torch.cat([r.token_valid for r in recs])
    save_file(tensors, str(path), metadata={"num_experts": str(recs[0].num_experts)})
    return Path(path)


def engine_routes(
    rollouts: RecordedRollouts,
    positions: Sequence[object],
    *,
    num_experts: int,
    moe_layers: Sequence[int] | None = None,
) -> list[RoutedExperts]:
    """Lay an engine's returned routes out per context: one dense record per context of ``rollouts`` (``T_b`` rows,
    row ``t`` = forward position ``t``, the last marked unrouted), the records :func:`save_routes` writes.

    Args:
        rollouts: the rollouts diagnose reads (:func:`~offpolicy.diagnose.load_rollouts`); their contexts fix the
            layout.
        positions: one entry per context, in the rollouts' order: the engine's per-position rows of the turn
            that sampled it, ``[P + T - 1, L_all, K]`` integer (a tensor, an array or nested lists; vLLM's
            :func:`offpolicy.adapters.vllm.routed_positions`, SGLang's :func:`offpolicy.adapters.sglang.
            routed_positions`), or for a multi-turn context a list of such arrays, one per sampled turn in order,
            each covering the context up to its turn's last sampled token (turns share the prefix). Position ``s``
            takes the row of the first turn that forwarded it, so each turn's sampled tokens keep the routes they
            were sampled with (a later turn's prefill of an earlier prefix is not used).
        num_experts: ``E``, routed experts per layer (ids checked in ``[0, E)``).
        moe_layers: indices of the MoE layers among the ``L_all`` recorded ones (None: all; a dense layer that an
            engine records as zeros must be left out).

    Raises:
        ValueError naming ``positions[b]`` (or ``positions[b][j]``, turn ``j``): a count of entries unlike the
        rollouts' contexts, a last turn whose rows do not cover the context but its final token (the engine
        returns ``P + T - 1`` rows: the last sampled token is never forwarded), an earlier turn whose rows do not
        end one before one of the context's sampled tokens, turns out of order, ``L`` or ``K`` unlike another
        turn's, an invalid route (id out of range, an expert twice in a token-layer).
    """
    from offpolicy.adapters.common import RecordError, route_positions

    ctx = rollouts.contexts
    if isinstance(positions, (str, bytes)) or not isinstance(positions, Sequence):
        raise TypeError(f"positions must be a list with one entry per context, got {type(positions).__name__}")
    if len(positions) != len(ctx):
        raise ValueError(f"positions holds {len(positions)} entries, the rollouts {len(ctx)} contexts (one entry per "
                         f"context, in the rollouts' order: one per JSONL line or seq_id)")
    sampled_at = [set() for _ in range(len(ctx))]
    for r, c in zip(rollouts.rows.tolist(), rollouts.cols.tolist()):
        sampled_at[r].add(c)
    shape: tuple[int, int] | None = None
    out = []
    for b, entry in enumerate(positions):
        length = int(ctx.lengths[b])
        single = isinstance(entry, Tensor) or hasattr(entry, "__array__") or (
            isinstance(entry, Sequence) and len(entry) > 0 and not _is_array_list(entry))
        turns = [entry] if single else list(entry)
        if not turns:
            raise ValueError(f"positions[{b}] holds no turn")
        rows = torch.zeros(length, 0, 0, dtype=torch.int64)
        done = 0
        for j, turn in enumerate(turns):
            name = f"positions[{b}]" if single else f"positions[{b}][{j}]"
            try:
                x = route_positions(turn, name)
            except RecordError as exc:
                raise ValueError(str(exc)) from None
            if x.dim() != 3:
                raise ValueError(f"{name} must be [positions, layers, top_k], got shape {tuple(x.shape)}")
            if moe_layers is not None:
                sel = list(moe_layers)
                if not sel or len(set(sel)) != len(sel) or any(not 0 <= i < x.shape[1] for i in sel):
                    raise ValueError(f"moe_layers must be distinct layer indices in [0, {x.shape[1]}), got {sel}")
                x = x[:, sel]
            if shape is None:
                shape = (int(x.shape[1]), int(x.shape[2]))
            elif (int(x.shape[1]), int(x.shape[2])) != shape:
                raise ValueError(f"{name}: [{x.shape[1]} layers, top_k {x.shape[2]}], positions[0]'s [{shape[0]} "
                                 f"layers, top_k {shape[1]}] (one model: every turn alike)")
            if rows.shape[1:] != x.shape[1:]:
                rows = torch.zeros(length, *x.shape[1:], dtype=torch.int64)
            end = int(x.shape[0])  # rows cover positions 0 .. end - 1; the turn's last sampled token is at ``end``
            if j == len(turns) - 1 and end != length - 1:
                hint = (": one row more than an engine returns, drop the row of the last sampled token (never "
                        "forwarded)" if end == length else
                        "; the context's last turn missing?" if not single and end in sampled_at[b] else "")
                raise ValueError(f"{name} holds {end} rows, its context {length} tokens: the last turn's rows must "
                                 f"cover {length - 1} positions (prompt + output - 1){hint}")
            if end not in sampled_at[b]:
                raise ValueError(f"{name} holds {end} rows: position {end} of context {b} is no recorded sampled "
                                 f"token (a turn's rows end one before its last sampled token: prompt + output - 1; "
                                 f"the context's sampled positions are {_spans(sampled_at[b])})")
            if end <= done:
                raise ValueError(f"{name} holds {end} rows, no more than the turn before ({done}): turns in order")
            rows[done:end] = x[done:end]
            done = end
        valid = torch.ones(length, dtype=torch.bool)
        valid[-1] = False
        try:
            out.append(RoutedExperts.from_ids(rows, num_experts, valid=valid))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"positions[{b}]: {exc} (token = context position)") from None
    return out


def save_engine_routes(
    rollouts: RecordedRollouts,
    positions: Sequence[object],
    path: str | Path,
    *,
    num_experts: int,
    moe_layers: Sequence[int] | None = None,
) -> Path:
    """Write the routes file ``offpolicy diagnose --attribute --routes`` reads from an engine's returned routes,
    aligned with ``rollouts``' contexts (:func:`engine_routes` lays them out; :func:`save_routes` writes)."""
    return save_routes(engine_routes(rollouts, positions, num_experts=num_experts, moe_layers=moe_layers), path)


def _is_array_list(entry: Sequence[object]) -> bool:
    """True when ``entry`` is a list of per-turn arrays (tensors, arrays, or 3-deep nested lists), False when it is
    one turn's nested lists ``[rows][layers][k]``."""
    first = entry[0]
    if isinstance(first, Tensor) or hasattr(first, "__array__"):
        return True
    if isinstance(first, Sequence) and first and isinstance(first[0], Sequence) and first[0] \
            and isinstance(first[0][0], Sequence):
        return True
    return False


def _spans(cols: set[int]) -> str:
    out, run = [], None
    for c in sorted(cols):
        if run and c == run[1] + 1:
            run[1] = c
        else:
            run = [c, c]
            out.append(run)
    return ", ".join(f"{a}..{b}" if a != b else f"{a}" for a, b in out[:8]) + (" ..." if len(out) > 8 else "")


def load_routes(path: str | Path, rollouts: RecordedRollouts) -> SequenceRoutes:
    """Read and check a routes file against ``rollouts``' contexts. Raises :class:`RolloutsError` naming ``path``
    and the tensor or metadata field: unreadable file, missing tensor, wrong dtype or shape, ids out of range or
    repeated within a token-layer, a row without a route (``route_valid`` False) that holds ids (a stale route),
    offsets that differ from the contexts' (misaligned: which sequence, how many rows against how many tokens)."""
    from safetensors import safe_open

    where = f"--routes {path}"
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            keys = set(f.keys())
            missing = [k for k in TENSORS if k not in keys]
            if missing:
                raise RolloutsError(f"{where}: not a routes file (missing tensor(s) {missing}; docs/diagnose.md"
                                    f"#routes-file)")
            t = {k: f.get_tensor(k) for k in keys}
    except RolloutsError:
        raise
    except Exception as exc:  # safetensors' own SafetensorError, OSError, ValueError on junk
        raise RolloutsError(f"{where}: not a readable safetensors file ({type(exc).__name__}: {str(exc)[:120]})") \
            from None
    try:
        e = json.loads(meta.get("num_experts", "null"))
    except ValueError:
        e = None
    if type(e) is not int or not 1 <= e <= 32768:
        raise RolloutsError(f"{where}, metadata 'num_experts': expected an integer in [1, 32768], got "
                            f"{meta.get('num_experts')!r:.40}")
    ids, off = t["expert_ids"], t["route_offsets"]
    if ids.dim() != 3 or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise RolloutsError(f"{where}, tensor 'expert_ids': integer [S, L, K] expected, got {ids.dtype} "
                            f"{list(ids.shape)}")
    if off.dim() != 1 or off.dtype not in (torch.int32, torch.int64):
        raise RolloutsError(f"{where}, tensor 'route_offsets': int [B + 1] expected, got {off.dtype} "
                            f"{list(off.shape)}")
    off = off.to(torch.int64)
    ctx = rollouts.contexts
    if off.numel() != ctx.offsets.numel():
        raise RolloutsError(f"{where}, tensor 'route_offsets': {off.numel() - 1} sequences, the rollouts hold "
                            f"{len(ctx)} (one routed sequence per context, in the rollouts' order)")
    if not torch.equal(off, ctx.offsets):
        lengths = off[1:] - off[:-1]
        bad = int((lengths != ctx.lengths).nonzero()[0, 0]) if not torch.equal(lengths, ctx.lengths) else \
            int((off[:-1] != ctx.offsets[:-1]).nonzero()[0, 0])
        rows, toks = int(lengths[bad]), int(ctx.lengths[bad])
        hint = (": the sequence's last position, which an engine never forwards, must be a row too (all 0, "
                "route_valid False)" if rows == toks - 1 else "")
        raise RolloutsError(f"{where}, tensor 'route_offsets': sequence {bad} holds {rows} route rows, its context "
                            f"{toks} tokens (misaligned with the rollouts; one row per context position){hint}")
    if ids.shape[0] != int(off[-1]):
        raise RolloutsError(f"{where}, tensor 'expert_ids': {ids.shape[0]} rows, route_offsets end at {int(off[-1])}")
    valid = t.get("route_valid")
    if valid is not None and (valid.dtype != torch.bool or tuple(valid.shape) != (ids.shape[0],)):
        raise RolloutsError(f"{where}, tensor 'route_valid': bool [S] = [{ids.shape[0]}] expected, got {valid.dtype} "
                            f"{list(valid.shape)}")
    try:
        rec = RoutedExperts.from_ids(ids, e, valid=valid)
    except (ValueError, TypeError) as exc:  # range, duplicates, stale padded rows: the record names token and layer
        raise RolloutsError(f"{where}, tensor 'expert_ids': {exc} (row = context position, back to back)") from None
    return SequenceRoutes(rec, off, str(path))


__all__ = ["SequenceRoutes", "engine_routes", "load_routes", "save_engine_routes", "save_routes"]
