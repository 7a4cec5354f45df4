"""Supervised warm-up: a starting policy that solves the task *sometimes*, cached between runs.

RL from a policy that never succeeds learns nothing (every GRPO group has reward 0); the demo starts instead
from a policy trained by teacher forcing on correct answers until its *expected* sampled success reaches a
target (about a third). The expected success of full-vocabulary sampling at temperature 1 is exact and needs no
sampling: ``P(correct | x) = prod_t p(y*_t | x, y*_<t) = exp(sum_t log p(y*_t))``, averaged over a fixed probe set.

The result depends only on the task, the model shape and this config, so it is cached under a key derived from
them (``<cache_dir>/warmup-<key>.pt``); every arm and every RL seed starts from the same weights. The cache folder
(:func:`default_cache_dir`) is ``$OFFPOLICY_CACHE_DIR/demo``, beside the CPU kernels' builds.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from offpolicy.demo.model import ModelConfig, TinyLM
from offpolicy.demo.task import SortTask
from offpolicy.fleet.sampler import support_mask

CACHE_FORMAT = 1
#: The library's cache root (the CPU kernels build under it too); the demo's warm-ups go to its ``demo/`` folder.
CACHE_ENV_VAR = "OFFPOLICY_CACHE_DIR"
#: The demo's former variable (the warm-up folder itself): still honoured, with a warning naming the new one.
OLD_CACHE_ENV_VAR = "OFFPOLICY_CACHE"


def default_cache_dir() -> Path:
    """The warm-up cache folder: ``$OFFPOLICY_CACHE_DIR/demo`` (``~/.cache/offpolicy/demo`` when unset). Where the
    former ``$OFFPOLICY_CACHE`` is set, its folder is used as before and a ``FutureWarning`` (once per process)
    asks for the new variable, so that no one's cache moves silently."""
    old = os.environ.get(OLD_CACHE_ENV_VAR)
    if old:
        _warn_old_variable(old)
        return Path(old)
    root = os.environ.get(CACHE_ENV_VAR)
    return (Path(root) if root else Path.home() / ".cache" / "offpolicy") / "demo"


@functools.cache
def _warn_old_variable(old: str) -> None:
    warnings.warn(f"{OLD_CACHE_ENV_VAR} is deprecated: set {CACHE_ENV_VAR} instead (the demo caches its warm-ups "
                  f"in $OFFPOLICY_CACHE_DIR/demo); using {OLD_CACHE_ENV_VAR}={old} this time", FutureWarning,
                  stacklevel=3)


@dataclass(frozen=True)
class WarmupConfig:
    """Supervised warm-up settings.

    Attributes:
        target_success: stop once the expected sampled success on the probe set reaches this.
        max_steps: hard stop (the run then starts from whatever success it reached).
        batch: prompts per step.
        lr: Adam learning rate.
        seed: initialisation and data seed (independent of the RL seed).
        probe: probe-set size; checked every ``check_every`` steps.
    """

    target_success: float = 0.3
    max_steps: int = 3000
    batch: int = 128
    lr: float = 1e-3
    seed: int = 1234
    probe: int = 512
    check_every: int = 5

    def __post_init__(self) -> None:
        if not 0.0 < self.target_success < 1.0:
            raise ValueError(f"target_success must lie in (0, 1), got {self.target_success}")
        for name in ("max_steps", "batch", "probe", "check_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"WarmupConfig.{name} must be >= 1, got {getattr(self, name)}")


def expected_success(model: TinyLM, task: SortTask, numbers: torch.Tensor,
                     generator: torch.Generator | None = None, top_p: float = 1.0) -> torch.Tensor:
    """``[B]`` fp32 probability that temperature-1 full-vocabulary sampling answers each prompt of
    ``numbers [B, n]`` correctly: exact for the plain task; with a scratchpad (``task.scratch > 0``) the scratchpad
    is sampled from ``model`` with ``generator`` (required) and the scored answer's probability after it is exact,
    an unbiased one-draw estimate. With ``top_p < 1`` the answer's tokens are scored under the model's nucleus
    (:func:`offpolicy.fleet.sampler.support_mask`, renormalised; 0 when a target token falls outside it): the
    success of top-p sampling (the scratchpad is still drawn from the full distribution)."""
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"expected_success: top_p must lie in (0, 1], got {top_p}")
    prefix = task.prompts(numbers)
    if task.scratch:
        if generator is None:
            raise ValueError("expected_success: generator is required when task.scratch > 0")
        with torch.no_grad():
            for _ in range(task.scratch):
                probs = torch.softmax(model(prefix)[:, -1].float(), dim=-1)
                prefix = torch.cat([prefix, torch.multinomial(probs, 1, generator=generator)], dim=1)
    seq = torch.cat([prefix, task.answers(numbers)], dim=1)
    with torch.no_grad():
        logits = model(seq[:, :-1]).float()
    start = task.prompt_len + task.scratch
    logp = torch.log_softmax(logits[:, start - 1:], dim=-1)
    if top_p < 1.0:
        flat = logp.reshape(-1, logp.shape[-1])
        keep = support_mask(flat, top_p=top_p).view_as(logp)
        logp = torch.log_softmax(logp.masked_fill(~keep, -math.inf), dim=-1)
    tgt = seq[:, start:]
    return logp.gather(-1, tgt.unsqueeze(-1)).squeeze(-1).sum(1).exp()


def cache_key(task: SortTask, model_cfg: ModelConfig, cfg: WarmupConfig) -> str:
    blob = json.dumps({"format": CACHE_FORMAT, "task": asdict(task), "model": model_cfg.to_dict(),
                       "warmup": asdict(cfg)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def warmup(task: SortTask, model_cfg: ModelConfig, cfg: WarmupConfig, cache_dir: Path | None,
           log=print) -> tuple[dict[str, torch.Tensor], dict]:
    """Return ``(state_dict, info)`` of the warmed-up policy, loading it from ``cache_dir`` when present.

    ``info`` holds ``steps``, ``success`` (expected sampled success on the probe set), ``seconds``, ``cached``.
    """
    path = None
    if cache_dir is not None:
        path = Path(cache_dir) / f"warmup-{cache_key(task, model_cfg, cfg)}.pt"
        if path.exists():
            blob = torch.load(path, map_location="cpu", weights_only=True)
            info = dict(blob["info"], cached=True)
            log(f"warm-up: loaded {path} (expected success {info['success']:.3f})")
            return blob["state"], info
    import time

    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    model = TinyLM(model_cfg)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    probe = task.sample_numbers(cfg.probe, gen)

    def probe_success() -> float:
        return float(expected_success(model, task, probe, torch.Generator().manual_seed(cfg.seed + 1)).mean())

    success = probe_success()
    step = 0
    while step < cfg.max_steps and success < cfg.target_success:
        numbers = task.sample_numbers(cfg.batch, gen)
        seq = torch.cat([task.prompts(numbers), task.targets(numbers, gen)], dim=1)
        logits = model(seq[:, :-1])[:, task.prompt_len - 1:]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), seq[:, task.prompt_len:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        if step % cfg.check_every == 0:
            success = probe_success()
    info = {"steps": step, "success": success, "seconds": time.perf_counter() - t0, "cached": False}
    log(f"warm-up: {step} supervised steps, expected sampled success {success:.3f} ({info['seconds']:.1f} s)")
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save({"state": state, "info": info}, tmp)
        tmp.replace(path)
    return state, info
