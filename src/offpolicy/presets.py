"""Named corrections: a small catalogue of recommended :class:`~offpolicy.Correction` s, each spelled in the public
keyword API with the evidence for it, and verl's rollout-correction presets mapped onto offpolicy (docs/spec.md#presets).

    import offpolicy as op
    corr = op.presets.correction("sc_mis")                      # Correction(weights="mis", bounds=(0.5, 5.0), ...)
    corr = op.presets.correction("seq_tis", ppo_clip=(0.2, 0.2))  # a keyword overrides or adds a field
    corr, proximal = op.presets.verl("decoupled_geo_rs_seq_tis")  # verl's preset; proximal: which log-probs to pass

A preset is nothing but its keywords: ``correction(name)`` is ``Correction(**PRESETS[name].keywords)``, so a preset
and its spelled-out form are equal objects and compute the same loss (tests/core/test_presets.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

from offpolicy.corrections import Correction, KLRejection, RatioRejection

#: The mixed-fleet study's and IcePop's masking band for MIS.
MIS_BAND = (0.5, 5.0)
#: verl's default ``rollout_is_threshold`` (the truncation ``C`` of its TIS presets).
VERL_IS_THRESHOLD = 2.0
#: verl's default ``rollout_rs_threshold`` of its geometric (``seq_mean_k1``) presets: ``"0.999_1.001"``.
VERL_GEO_BAND = (0.999, 1.001)


@dataclass(frozen=True)
class Preset:
    """One named correction.

    Attributes:
        name: the catalogue key.
        keywords: the ``Correction`` keywords (read-only mapping), its spelled-out form.
        needs: what the ``policy_loss`` call must pass besides (empty: nothing).
        evidence: the paper or peer and what it was shown to do.
        verl: verl 0.9.1 presets this equals (with the PPO arguments verl's mode adds; :data:`VERL_PRESETS`).
    """

    name: str
    keywords: Mapping[str, Any]
    needs: str
    evidence: str
    verl: tuple[str, ...] = ()

    def correction(self, **overrides: Any) -> Correction:
        """``Correction(**keywords, **overrides)`` (an override replaces a keyword of the preset)."""
        return Correction(**{**self.keywords, **overrides})


def _preset(name: str, keywords: dict[str, Any], needs: str, evidence: str, verl: tuple[str, ...] = ()) -> Preset:
    return Preset(name, MappingProxyType(dict(keywords)), needs, evidence, verl)


def _geo_band(lo: float, hi: float) -> RatioRejection:
    """verl's ``seq_mean_k1`` entry ``"lo_hi"``: it keeps ``log lo <= mean_t(-log r_t) <= log hi``, i.e. the
    geometric-mean ratio in ``[1 / hi, 1 / lo]`` (docs/migrating.md, the k1 row)."""
    return RatioRejection(1 / hi, 1 / lo, "geometric")


PRESETS: Mapping[str, Preset] = MappingProxyType({p.name: p for p in (
    _preset(
        "sc_mis", dict(weights="mis", bounds=MIS_BAND, score_centering=True),
        "candidates= (a head or support record); a support record (kind='support') also replays the top-p / top-k "
        "mask, the study's SC + MIS + top-p",
        "The mixed-fleet study (N. Jiang, 'Implementing mixed-precision RL with diverse accelerators', 2026; Miles + "
        "SGLang samplers on six accelerators in BF16 / FP8 / NVFP4, a BF16 Megatron trainer, fully asynchronous): "
        "uncorrected GRPO collapsed on both the mixed and the homogeneous samplers, SC + MIS with or without top-p "
        "mask replay stayed stable, and with top-p the mixed samplers matched the homogeneous ones at 4.7x their "
        "sampler-trainer KL for about 15% less cost per update. offpolicy's toy replication: docs/demo.md."),
    _preset(
        "icepop", dict(weights="mis", bounds=MIS_BAND), "",
        "IcePop (Ring-1T, arXiv 2510.18855): masks the tokens whose training / inference probability ratio leaves "
        "[0.5, 5] (their gradient is dropped, not clipped into the update), for the mismatch that grows in MoE RL; "
        "verl's token IcePop presets default to this band.",
        ("decoupled_token_icepop", "bypass_pg_token_icepop")),
    _preset(
        "token_tis", dict(weights="tis", bounds=VERL_IS_THRESHOLD), "",
        "Truncated importance sampling per token, min(p / q, C) (Yao et al. 2025, 'Your efficient RL framework "
        "secretly brings you off-policy RL training'): the correction proposed for the vLLM / FSDP mismatch; "
        "C = 2 is verl's default.",
        ("decoupled_token_is",)),
    _preset(
        "seq_tis", dict(weights="tis", bounds=VERL_IS_THRESHOLD, level="sequence"), "seq_ids=",
        "Sequence-level truncated IS, min(prod_t r_t, C) (Liu, Li et al. 2025, 'When speed kills stability', part 2): "
        "the sequence ratio is the one that corrects a sequence-level objective without the token-level bias, at "
        "the cost of variance the truncation bounds; verl's default C = 2.",
        ("decoupled_seq_is", "bypass_pg_is")),
    _preset(
        "geo_rs_seq_tis", dict(weights="tis", bounds=VERL_IS_THRESHOLD, level="sequence",
                               rejections=(_geo_band(*VERL_GEO_BAND),), rejected_in_normalizer=False), "seq_ids=",
        "Sequence TIS plus a rejection of the sequences whose geometric-mean ratio leaves [1/1.001, 1/0.999] "
        "(Liu, Li et al. 2025, part 3: rejecting rather than clipping the toxic tails, with a length-normalised "
        "statistic that long sequences do not trip by length alone); verl's default thresholds.",
        ("decoupled_geo_rs_seq_tis", "bypass_pg_geo_rs_seq_tis")),
)})


def names() -> tuple[str, ...]:
    """The catalogue's names, in catalogue order."""
    return tuple(PRESETS)


def get(name: str) -> Preset:
    """The :class:`Preset` called ``name``; a ``ValueError`` naming the choices for an unknown one."""
    if not isinstance(name, str) or name not in PRESETS:
        raise ValueError(f"preset must be one of {names()}, got {name!r}")
    return PRESETS[name]


def correction(name: str, **overrides: Any) -> Correction:
    """``Correction(**get(name).keywords, **overrides)``."""
    return get(name).correction(**overrides)


def find(corr: Correction) -> str | None:
    """The name of the preset equal to ``corr``, or None."""
    for name, preset in PRESETS.items():
        if preset.correction() == corr:
            return name
    return None


# ---------------------------------------------------------------------------------------------------------------
# verl 0.9.1's RolloutCorrectionConfig presets
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VerlPreset:
    """One verl preset and its offpolicy form.

    Attributes:
        name: the ``RolloutCorrectionConfig`` class method.
        fields: the config it returns at its default arguments (``rollout_is``, ``rollout_is_threshold``,
            ``rollout_rs``, ``rollout_rs_threshold``, ``bypass_mode``, ``loss_type``).
        keywords: the ``Correction`` keywords of its rollout-correction part, or None where offpolicy does not
            reproduce it.
        ppo: True where verl's loss is its PPO actor loss (decoupled mode, bypass ``ppo_clip``): add the actor's
            ``ppo_clip=(clip_ratio_low, clip_ratio_high), dual_clip=clip_ratio_c``.
        proximal: the ``proximal_logprobs`` to pass: ``"old"`` (verl's ``old_log_prob``), ``"rollout"`` (the
            sampler's), or None (none).
        note: why it is not reproduced, or what to know.
    """

    name: str
    fields: Mapping[str, Any]
    keywords: Mapping[str, Any] | None
    ppo: bool
    proximal: str | None
    note: str = ""


def _verl(name: str, rollout_is=None, is_threshold=VERL_IS_THRESHOLD, rollout_rs=None, rs_threshold=None,
          bypass=False, loss_type="ppo_clip", keywords=None, note="") -> VerlPreset:
    fields = dict(rollout_is=rollout_is, rollout_is_threshold=is_threshold, rollout_rs=rollout_rs,
                  rollout_rs_threshold=rs_threshold, bypass_mode=bypass, loss_type=loss_type)
    ppo = not bypass or loss_type == "ppo_clip"
    proximal = None if bypass and loss_type == "reinforce" else ("rollout" if bypass else "old")
    kw = None if keywords is None else MappingProxyType(dict(keywords))
    return VerlPreset(name, MappingProxyType(fields), kw, ppo, proximal, note)


_TIS = dict(weights="tis", bounds=VERL_IS_THRESHOLD)
_ICEPOP = dict(weights="mis", bounds=MIS_BAND)
_RS = dict(rejected_in_normalizer=False)  # verl removes rejected tokens from response_mask, so from the normaliser
_GEO = (_geo_band(*VERL_GEO_BAND),)
_K3 = (KLRejection(0.01, "k3", "seq_mean"),)
_BYPASS_PPO_RS = ("bypass mode's PPO with rollout_rs: verl measures the rejection on the current policy "
                  "(log p - log q); offpolicy's rules act on pi_prox / q, which is 1 under proximal_logprobs=rollout. "
                  "Exact by hand: verl's mask from logp.detach() - lq in loss_mask (docs/migrating.md)")

VERL_PRESETS: Mapping[str, VerlPreset] = MappingProxyType({p.name: p for p in (
    _verl("decoupled_token_is", "token", keywords=_TIS),
    _verl("decoupled_seq_is", "sequence", keywords=dict(_TIS, level="sequence")),
    _verl("decoupled_token_icepop", "token", "0.5_5.0", keywords=_ICEPOP),
    _verl("decoupled_seq_is_rs", "sequence", rollout_rs="seq_sum_k1", rs_threshold="0.5_2.0",
          keywords=dict(_TIS, level="sequence", rejections=(RatioRejection(0.5, 2.0, "sequence"),), **_RS)),
    _verl("decoupled_geo_rs", rollout_rs="seq_mean_k1", rs_threshold="0.999_1.001",
          keywords=dict(rejections=_GEO, **_RS)),
    _verl("bypass_ppo_clip", bypass=True, keywords={}),
    _verl("bypass_ppo_clip_geo_rs", rollout_rs="seq_mean_k1", rs_threshold="0.999_1.001", bypass=True,
          note=_BYPASS_PPO_RS),
    _verl("bypass_ppo_clip_k3_rs", rollout_rs="seq_mean_k3", rs_threshold=0.01, bypass=True, note=_BYPASS_PPO_RS),
    _verl("bypass_pg_is", "sequence", bypass=True, loss_type="reinforce",
          keywords=dict(_TIS, level="sequence")),
    _verl("bypass_pg_token_icepop", "token", "0.5_5.0", bypass=True, loss_type="reinforce", keywords=_ICEPOP),
    _verl("bypass_pg_geo_rs", rollout_rs="seq_mean_k1", rs_threshold="0.999_1.001", bypass=True,
          loss_type="reinforce", keywords=dict(rejections=_GEO, **_RS)),
    _verl("decoupled_geo_rs_seq_tis", "sequence", rollout_rs="seq_mean_k1", rs_threshold="0.999_1.001",
          keywords=dict(_TIS, level="sequence", rejections=_GEO, **_RS)),
    _verl("decoupled_geo_rs_token_tis", "token", rollout_rs="seq_mean_k1", rs_threshold="0.999_1.001",
          keywords=dict(_TIS, rejections=_GEO, **_RS)),
    _verl("bypass_pg_geo_rs_seq_tis", "sequence", rollout_rs="seq_mean_k1", rs_threshold="0.999_1.001",
          bypass=True, loss_type="reinforce", keywords=dict(_TIS, level="sequence", rejections=_GEO, **_RS)),
    _verl("bypass_pg_geo_rs_token_tis", "token", rollout_rs="seq_mean_k1", rs_threshold="0.999_1.001",
          bypass=True, loss_type="reinforce", keywords=dict(_TIS, rejections=_GEO, **_RS)),
    _verl("decoupled_k3_rs", rollout_rs="seq_mean_k3", rs_threshold=0.01, keywords=dict(rejections=_K3, **_RS)),
    _verl("decoupled_k3_rs_seq_tis", "sequence", rollout_rs="seq_mean_k3", rs_threshold=0.01,
          keywords=dict(_TIS, level="sequence", rejections=_K3, **_RS)),
    _verl("decoupled_k3_rs_token_tis", "token", rollout_rs="seq_mean_k3", rs_threshold=0.01,
          keywords=dict(_TIS, rejections=_K3, **_RS)),
    _verl("disabled", keywords={}, note="metrics only: plain PPO on old_log_prob, no weight, no rejection"),
)})


def verl(name: str, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
         clip_ratio_c: float = 3.0) -> tuple[Correction, str | None]:
    """verl 0.9.1's ``RolloutCorrectionConfig.<name>()`` (default arguments) as ``(correction, proximal)``:
    pass ``proximal_logprobs=`` verl's ``old_log_prob`` for ``"old"``, the sampler's log-probs for ``"rollout"``,
    nothing for None. The actor's clip ratios enter where verl's loss is PPO (decoupled mode, bypass
    ``ppo_clip``; verl's vanilla loss always applies the dual clip ``clip_ratio_c``).

    Raises:
        ValueError: an unknown name (the choices named), or a preset offpolicy does not reproduce (why).
    """
    if not isinstance(name, str) or name not in VERL_PRESETS:
        raise ValueError(f"verl preset must be one of {tuple(VERL_PRESETS)}, got {name!r}")
    vp = VERL_PRESETS[name]
    if vp.keywords is None:
        raise ValueError(f"verl preset {name!r} is not reproduced by a Correction: {vp.note}")
    for arg, value in (("clip_ratio_low", clip_ratio_low), ("clip_ratio_high", clip_ratio_high),
                       ("clip_ratio_c", clip_ratio_c)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{arg} must be a finite number >= 0, got {value!r}")
    ppo = dict(ppo_clip=(clip_ratio_low, clip_ratio_high), dual_clip=clip_ratio_c) if vp.ppo else {}
    return Correction(**vp.keywords, **ppo), vp.proximal
