"""One diagnose check's outcome: :class:`Finding`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Finding:
    """One semantic check. ``ok`` False means a likely mistake; ``mistake`` is its short name.

    ``mismatch`` True (with ``ok`` True) marks a sampler-trainer difference that no mistaken reading explains
    (stale weights, other numerics): measured in the divergence tables, not a record bug.
    """

    check: str
    ok: bool
    message: str
    mistake: str | None = None
    evidence: dict[str, float | int | str] = field(default_factory=dict)
    mismatch: bool = False
