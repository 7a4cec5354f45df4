"""The live fleet's toy run: a tiny Qwen3 learns a verifiable task from two or more engine groups of different
numerics, the trainer in the driver, the engines as Ray actors (``examples/live_fleet.py`` and the live test).

Task: every prompt is ``PROMPT_LEN`` random tokens; a session samples ``turns`` turns of ``turn_tokens`` tokens
with one fixed *tool* token (``TOOL_TOKEN``, not trained) between turns; the reward is the share of sampled tokens
in the target set (ids divisible by ``TARGET_MOD``), about ``1 / TARGET_MOD`` for the random model. Advantages are
GRPO's over the ``samples`` sessions of one prompt; the loss is ``op.policy_loss`` with masked importance sampling,
score centering and mask replay of the recorded top-p/top-k supports, with per-group and per-staleness metrics.
"""

from __future__ import annotations

import copy
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

import offpolicy as op
from offpolicy.advantages import grpo, per_token
from offpolicy.adapters.fleet_live.fleet_runner import LiveBatch, LiveFleet
from offpolicy.adapters.fleet_live.group_attribution import attribute_groups
from offpolicy.adapters.vllm import build_sampling_params
from offpolicy.fleet.table import FleetMetrics

TARGET_MOD = 4
TOOL_TOKEN = 1
PROMPT_LEN = 4


def build_tiny_qwen3(path: Path | None, vocab: int = 128, seed: int = 0) -> torch.nn.Module:
    """A random 2-layer Qwen3 (hidden 128, 2 heads of 64: vLLM's CPU attention needs head_dim 64), untied, fp32,
    its output layer scaled by 8 so top-p / top-k filtering matters; saved with ``save_pretrained`` to ``path``
    (when given) for the engines to start from."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
                      tie_word_embeddings=False)
    model = Qwen3ForCausalLM(cfg).float()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    if path is not None:
        model.save_pretrained(path)
    return model


def rewards_of(batch: LiveBatch) -> torch.Tensor:
    """``[B]`` float32: each session's share of trained sampled tokens in the target set."""
    b = batch.batch
    hit = ((b.tokens % TARGET_MOD) == 0) & b.loss_mask
    n = torch.zeros(len(batch.session_ids)).index_add_(0, b.seq_ids, b.loss_mask.float())
    return torch.zeros(len(batch.session_ids)).index_add_(0, b.seq_ids, hit.float()) / n.clamp_min(1)


@dataclass
class RunConfig:
    """The toy run's knobs (defaults: the example's few dozen steps)."""

    steps: int = 30
    prompts: int = 4
    samples: int = 4
    turns: int = 2
    turn_tokens: int = 6
    temperature: float = 1.0
    top_p: float = 0.95
    top_k: int = 24
    lr: float = 2e-3
    seed: int = 0


@dataclass
class StepLog:
    """What one step produced (the run's history)."""

    step: int
    version: int
    reward: float
    loss: float
    seconds: float
    metrics: dict[str, float] = field(default_factory=dict)
    served: dict[str, int] = field(default_factory=dict)
    staleness: dict[int, int] = field(default_factory=dict)
    sessions: list[dict[str, object]] = field(default_factory=list)
    attribution: dict[str, dict[str, float | None]] = field(default_factory=dict)


def session_log(batch: LiveBatch) -> list[dict[str, object]]:
    """Per session of ``batch``: its ``id`` and, per turn, ``[group, served version, tokens]`` (the history's
    audit trail: what was sent, served where, at which version, and trained)."""
    return [{"id": str(sid), "turns": [[t.group, t.version, len(t.record)] for t in ts]}
            for sid, ts in zip(batch.session_ids, batch.turns)]


def audit(steps: list[dict[str, object]], sent: int, turns: int) -> dict[str, int]:
    """Sessions ``sent`` (opened by the fleet) against those a history's ``steps`` trained: ``trained`` (distinct
    ids), ``duplicated`` (trained more than once), ``incomplete`` (trained with fewer than ``turns`` turns) and
    ``lost`` (sent but never trained: the batch in flight when a run stops, and nothing else)."""
    ids = [s["id"] for step in steps for s in step["sessions"]]
    short = sum(len(s["turns"]) != turns for step in steps for s in step["sessions"])
    return {"sent": sent, "trained": len(set(ids)), "duplicated": len(ids) - len(set(ids)), "incomplete": short,
            "lost": sent - len(set(ids))}


def check_history(steps: Sequence[Mapping[str, object]], turns: int, resumed_at: int = 0) -> list[str]:
    """What is wrong with a run's history, as plain sentences (empty when nothing is): the checks a killed and
    resumed run must pass.

    Args:
        steps: the history's steps in order, each a mapping (``history.json``'s ``steps``, or ``vars(StepLog)``)
            with ``step``, ``version`` (the trainer's version the step trained at), ``staleness`` (trained tokens
            per ``version - stamp``; keys int or str) and ``sessions`` (``{"id", "turns": [[group, served version,
            tokens], ...]}``, :func:`session_log`).
        turns: the turns every session has.
        resumed_at: the index of the first step a rerun trained (``history.json``'s ``resumed_at``; 0: none).

    Checked: steps numbered ``0, 1, ...`` (none repeated or skipped); the trainer's version grows step after step;
    no session id trained twice, and each with ``turns`` turns; no turn served at a version after its step's; each
    step's tokens per staleness, from its sessions' served versions, equal the step's ``staleness`` (from the
    tokens' stamps); and after a resume no turn served at a version older than the restored weights' (the version
    the first resumed step trained at: an older one holds weights of before the checkpoint, of a step the killed
    run trained after it, or of the rerun's freshly built model).
    """
    if isinstance(turns, bool) or not isinstance(turns, int) or turns < 1:
        raise ValueError(f"turns must be an integer >= 1, got {turns!r}")
    if isinstance(resumed_at, bool) or not isinstance(resumed_at, int) or not 0 <= resumed_at <= len(steps):
        raise ValueError(f"resumed_at must be an integer in [0, {len(steps)}], got {resumed_at!r}")
    problems: list[str] = []
    numbers = [int(s["step"]) for s in steps]
    if numbers != list(range(len(steps))):
        problems.append(f"steps are numbered {numbers}, not 0..{len(steps) - 1}")
    versions = [int(s["version"]) for s in steps]
    for a, b, n in zip(versions, versions[1:], numbers[1:]):
        if b <= a:
            problems.append(f"step {n} trained at version {b}, not after the previous step's {a}")
    seen: dict[str, int] = {}
    for s in steps:
        n, version = int(s["step"]), int(s["version"])
        counted: dict[int, int] = {}
        for session in s["sessions"]:
            sid = str(session["id"])
            if sid in seen:
                problems.append(f"session {sid} trained twice (steps {seen[sid]} and {n})")
            seen.setdefault(sid, n)
            if len(session["turns"]) != turns:
                problems.append(f"session {sid} of step {n} trained with {len(session['turns'])} turns, not {turns}")
            for group, served, tokens in session["turns"]:
                if int(served) > version:
                    problems.append(f"session {sid} of step {n}: {group!r} served version {served}, after the "
                                    f"step's {version}")
                counted[version - int(served)] = counted.get(version - int(served), 0) + int(tokens)
        stamped = {int(k): int(v) for k, v in s["staleness"].items()}
        if counted != stamped:
            problems.append(f"step {n}: tokens per staleness from the served versions {dict(sorted(counted.items()))}"
                            f" differ from the stamps' {dict(sorted(stamped.items()))}")
    if 0 < resumed_at < len(steps):
        restored = versions[resumed_at]
        old = sorted({int(t[1]) for s in steps[resumed_at:] for session in s["sessions"] for t in session["turns"]
                      if int(t[1]) < restored})
        if old:
            problems.append(f"after the resume at step {numbers[resumed_at]} turns were served at versions {old}, "
                            f"older than the restored weights' version {restored}")
    return problems


def staleness_counts(batch: LiveBatch, trained_at: int) -> dict[int, int]:
    """Trained tokens per staleness ``trained_at - served version`` (the loss's ``current_version`` minus each
    token's stamp)."""
    b = batch.batch
    lag = (trained_at - b.versions)[b.loss_mask]
    return {int(k): int(n) for k, n in zip(*torch.unique(lag, return_counts=True))}


def save_checkpoint(path: Path, state: dict[str, object]) -> None:
    """Write ``state`` with ``torch.save``, atomically (a kill mid-write leaves the previous checkpoint)."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def resumed_history(path: Path | None) -> list[StepLog]:
    """The steps a checkpoint at ``path`` holds (empty when there is none)."""
    if path is None or not Path(path).exists():
        return []
    return [StepLog(**h) for h in torch.load(path, weights_only=False)["history"]]


def train(
    fleet: LiveFleet,
    model: torch.nn.Module,
    cfg: RunConfig,
    on_step: Callable[[StepLog, LiveBatch, FleetMetrics], None] | None = None,
    *,
    checkpoint: Path | None = None,
    checkpoint_every: int = 1,
    attribute_every: int | None = None,
) -> tuple[list[StepLog], FleetMetrics]:
    """Train ``model`` for ``cfg.steps`` steps on batches from ``fleet`` (started, version 0 published; a run that
    resumes from ``checkpoint`` needs no publish first).

    Rollouts run one step ahead of the trainer (the batch of step ``k + 1`` is sampled while step ``k`` trains),
    so each group serves whatever version it last loaded: staleness from the real clock. After each optimizer step
    the weights are published as the next version. Each rollout is told the version it will be trained at
    (``trained_at``: the current one for the first batch, the next one for a batch sampled during a step), so the
    fleet's ``max_staleness`` bounds what the loss sees; ``StepLog.staleness`` counts the trained tokens per
    staleness.

    Resume: with ``checkpoint`` (a file path), the trainer's state (model, optimizer, prompt generator, step, the
    fleet's session count and the history so far) is written there after every ``checkpoint_every``-th step and
    the last. If the file exists when ``train`` starts, the run resumes from it: the state is restored, the
    restored weights are published as the fleet's next version, past the checkpoint's and past any the channel
    holds (the engines load them at their next call; nothing needs publishing before, so a rerun publishes no
    weights but the restored ones), and training goes on at the step after the checkpoint. Lost in a kill: the batch in flight and the steps after the
    last checkpoint (with ``checkpoint_every=1``, only the batch in flight); session ids are never reused.

    Attribution: with ``attribute_every=k``, every ``k``-th step's batch is attributed before the step trains on it
    (:func:`~.group_attribution.attribute_groups`: the trainer's model at the step's version, a frozen copy of
    every version published since the oldest one the previous attributed batch served, the groups' formats) and
    ``StepLog.attribution`` holds ``{group: {"tokens", "mean_abs_log_r", part: share}}`` (NaN shares as ``None``).
    A batch holding a version no longer kept (one published before a resume) gets no attribution.
    """
    resuming = checkpoint is not None and Path(checkpoint).exists()
    if fleet.version is None and not resuming:
        raise RuntimeError("train: publish the model's weights first (fleet.publish(model.state_dict(), 0))")
    if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int) or checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be an integer >= 1, got {checkpoint_every!r}")
    if attribute_every is not None and (isinstance(attribute_every, bool) or not isinstance(attribute_every, int)
                                        or attribute_every < 1):
        raise ValueError(f"attribute_every must be an integer >= 1 or None, got {attribute_every!r}")
    kept: dict[int, torch.nn.Module] = {}  # frozen copies of published versions, for the attribution
    gen = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    history: list[StepLog] = []
    first = 0
    if resuming:
        state = torch.load(checkpoint, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        gen.set_state(state["generator"])
        history = [StepLog(**h) for h in state["history"]]
        first = int(state["step"]) + 1
        fleet.continue_sessions_from(int(state["sessions_opened"]))
        # past the checkpoint's version too: a channel that did not outlive the killed trainer (Ray's object
        # store) starts again at 0, and versions must still grow across the resume
        fleet.publish(model.state_dict(), max(fleet.next_version(), int(state["version"]) + 1))
    sp = build_sampling_params(max_tokens=cfg.turn_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                               top_k=cfg.top_k, record="support", max_logprobs=fleet.settings_max_logprobs)
    corr = op.Correction(weights="mis", score_centering=True)
    vocab = model.config.vocab_size
    metrics = FleetMetrics(fleet.groups)

    def submit(trained_at: int):
        prompts = torch.randint(2, vocab, (cfg.prompts, PROMPT_LEN), generator=gen).tolist()
        return fleet.submit([p for p in prompts for _ in range(cfg.samples)], sp, turns=cfg.turns,
                            between=[TOOL_TOKEN], trained_at=trained_at)

    version = fleet.version
    if attribute_every is not None:
        kept[version] = copy.deepcopy(model).eval()
    if first >= cfg.steps:
        return history, metrics
    pending = submit(version)
    for step in range(first, cfg.steps):
        t0 = time.monotonic()
        batch = pending.result()
        if step + 1 < cfg.steps:
            pending = submit(version + 1)  # sampled during this step, trained after its publish
        rewards = rewards_of(batch)
        prompt_of = torch.arange(len(batch.session_ids)) // cfg.samples
        adv = per_token(grpo(rewards, prompt_of), batch.batch.seq_ids)
        b = batch.batch
        attribution: dict[str, dict[str, float | None]] = {}
        if attribute_every is not None and step % attribute_every == 0:
            served = set(b.versions[b.loss_mask].tolist())
            if served and served - {version} <= set(kept):
                shares = attribute_groups(batch, fleet.groups, model=model, current_version=version, weights=kept,
                                          top_p=cfg.top_p, top_k=cfg.top_k, step=step)
                attribution = {g: {k: (v if math.isfinite(v) else None) for k, v in r.items()}
                               for g, r in shares.items()}
            if served:
                kept = {v: m for v, m in kept.items() if v >= min(served)}
        model.train()
        logits = b.gather(model(batch.sequences).logits)
        out = op.policy_loss(logits, b.tokens, b.sampler_logprobs, adv, candidates=b.candidates,
                             loss_mask=b.loss_mask, temperature=cfg.temperature, correction=corr,
                             seq_ids=b.seq_ids, groups=batch.group_ids, versions=b.versions,
                             current_version=version)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        metrics.update_from_metrics(out.metrics)
        version += 1
        fleet.publish(model.state_dict(), version)
        if attribute_every is not None:
            kept[version] = copy.deepcopy(model).eval()
        log = StepLog(step, version - 1, float(rewards.mean()), float(out.loss.detach()), time.monotonic() - t0,
                      {k: float(v) for k, v in out.metrics.items()}, batch.served_counts(),
                      staleness_counts(batch, version - 1), session_log(batch), attribution)
        history.append(log)
        if checkpoint is not None and ((step + 1) % checkpoint_every == 0 or step + 1 == cfg.steps):
            save_checkpoint(Path(checkpoint), {
                "model": model.state_dict(), "optimizer": opt.state_dict(), "generator": gen.get_state(),
                "step": step, "version": version, "sessions_opened": fleet.sessions_opened,
                "history": [vars(h) for h in history]})
        if on_step is not None:
            on_step(log, batch, metrics)
    return history, metrics
