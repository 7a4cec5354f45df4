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


#: user-supplied labels (sampler group names) are cut to this many characters in text, markdown and plots
LABEL_WIDTH = 40


def short_label(text: object, width: int = LABEL_WIDTH) -> str:
    """``text`` bounded to ``width`` characters for display, an ellipsis marking a cut; control characters (a
    newline in a group name) shown as ``?``. Reports keep the full name in ``report.json``."""
    s = str(text)
    if len(s) > width:
        s = s[: width - 1] + "\u2026"
    return "".join(ch if ch.isprintable() else "?" for ch in s)
