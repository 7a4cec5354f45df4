"""The diagnose report: what was measured and found, as plain text, a rich table, markdown and JSON."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path

from offpolicy.corrections.correction import Correction
from offpolicy.diagnose.divergence import Divergence
from offpolicy.diagnose.findings import Finding, short_label


def correction_call(corr: Correction) -> str:
    """``Correction(...)`` with only the keywords that differ from their defaults (the full repr lists every field of
    the family, one line of several hundred characters)."""
    default = Correction()
    args = [f"{f.name}={getattr(corr, f.name)!r}" for f in fields(corr)
            if f.repr and getattr(corr, f.name) != getattr(default, f.name)]
    return f"Correction({', '.join(args)})"


@dataclass(frozen=True)
class DiagnoseReport:
    """Everything ``offpolicy diagnose`` measured. ``by_group`` keys are group names; ``by_staleness`` keys are
    ``current_version - version`` (``None`` key absent when versions are unknown)."""

    overall: Divergence
    by_group: dict[str, Divergence]
    by_staleness: dict[int, Divergence]
    findings: list[Finding]
    correction: Correction | None
    reasons: list[str]
    candidate_kind: str | None
    current_version: int | None
    plots: list[str] = field(default_factory=list)

    @property
    def mistakes(self) -> list[str]:
        """The short names of the likely mistakes found (empty: the record's semantics look right)."""
        return sorted({f.mistake for f in self.findings if not f.ok and f.mistake})

    @property
    def ok(self) -> bool:
        return not self.mistakes

    def as_dict(self) -> dict:
        return {
            "ok": self.ok, "mistakes": self.mistakes, "overall": self.overall.as_dict(),
            "by_group": {k: v.as_dict() for k, v in self.by_group.items()},
            "by_staleness": {str(k): v.as_dict() for k, v in self.by_staleness.items()},
            "findings": [{"check": f.check, "ok": f.ok, "mistake": f.mistake, "message": f.message,
                          "evidence": f.evidence} for f in self.findings],
            "correction": None if self.correction is None else repr(self.correction),
            "reasons": self.reasons, "candidate_kind": self.candidate_kind, "current_version": self.current_version,
            "plots": self.plots,
        }

    def json(self) -> str:
        """:meth:`as_dict` as strict JSON (RFC 8259): every non-finite number (a k1 over no finite ratio, an
        infinite error) is written as ``null``; ``allow_nan=False`` guarantees no ``NaN`` / ``Infinity``."""
        return json.dumps(finite_json(self.as_dict()), indent=1, allow_nan=False)

    def _rows(self) -> list[tuple[str, Divergence]]:
        rows = [("all", self.overall)]
        rows += [(f"group {short_label(k)}", v) for k, v in self.by_group.items()]
        rows += [(f"staleness {k}", v) for k, v in sorted(self.by_staleness.items())]
        return rows

    @property
    def headline(self) -> str:
        """The verdict line: ``offpolicy diagnose: OK`` or ``offpolicy diagnose: MISTAKES FOUND: a, b``."""
        return f"offpolicy diagnose: {'OK' if self.ok else 'MISTAKES FOUND: ' + ', '.join(self.mistakes)}"

    def text(self) -> str:
        """Plain-text summary (what a non-TTY terminal gets)."""
        lines = [self.headline, "",
                 f"{'slice':<20}{'tokens':>8}{'k1':>10}{'k3':>10}{'extreme':>9}"]
        for name, d in self._rows():
            lines.append(f"{name:<20}{d.tokens:>8}{d.k1:>10.4f}{d.k3:>10.4f}{d.extreme_share:>9.2%}")
        lines += ["", "semantics:"]
        lines += [f"  [{'XX' if not f.ok else '~~' if f.mismatch else 'ok'}] {f.check}: {f.message}"
                  for f in self.findings]
        lines += ["", f"recommended correction: {correction_call(self.correction)}" if self.correction else
                  "recommended correction: none until the record is fixed"]
        lines += [f"  - {r}" for r in self.reasons]
        return "\n".join(lines)

    def markdown(self) -> str:
        out = ["# offpolicy diagnose", "",
               f"**Verdict:** {'the record semantics look right' if self.ok else 'likely mistakes: ' + ', '.join(f'`{m}`' for m in self.mistakes)}",
               "", "## Divergence (k1, k3: estimators of KL(q || p); extreme: share of r outside [0.2, 5])", "",
               "| slice | tokens | k1 | k3 | extreme | non-finite |", "|---|---:|---:|---:|---:|---:|"]
        for name, d in self._rows():
            out.append(f"| {name} | {d.tokens} | {d.k1:.5f} | {d.k3:.5f} | {d.extreme_share:.2%} | {d.non_finite} |")
        out += ["", "## Semantics", "", "| check | verdict | finding | evidence |", "|---|---|---|---|"]
        for f in self.findings:
            ev = ", ".join(f"{k}={v}" for k, v in f.evidence.items())
            verdict = "**" + str(f.mistake) + "**" if not f.ok else "mismatch" if f.mismatch else "ok"
            out.append(f"| {f.check} | {verdict} | {f.message} | {ev} |")
        out += ["", "## Recommended correction", "",
                f"`{self.correction!r}`" if self.correction else "None until the record is fixed.", ""]
        out += [f"- {r}" for r in self.reasons]
        if self.plots:
            out += ["", "## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in self.plots]
        return "\n".join(out) + "\n"

    def print(self, stream=None) -> None:
        """A rich table on a terminal (when rich is installed), plain text otherwise."""
        import sys

        stream = sys.stdout if stream is None else stream
        if stream.isatty():
            try:
                from rich.console import Console
                from rich.markup import escape
                from rich.table import Table
            except ImportError:
                Console = None
            if Console is not None:
                con = Console(file=stream)
                con.print(self.headline, style="bold green" if self.ok else "bold red", highlight=False)
                tab = Table(title="offpolicy diagnose: sampler vs trainer")
                for col in ("slice", "tokens", "k1", "k3", "extreme"):
                    tab.add_column(col, justify="left" if col == "slice" else "right")
                for name, d in self._rows():
                    tab.add_row(escape(name), str(d.tokens), f"{d.k1:.4f}", f"{d.k3:.4f}", f"{d.extreme_share:.2%}")
                con.print(tab)
                for f in self.findings:
                    tag = f.mistake if not f.ok else "mismatch" if f.mismatch else "ok"
                    con.print(f"[{'bold red' if not f.ok else 'yellow' if f.mismatch else 'green'}]{tag}[/] {f.check}: "
                              f"{escape(f.message)}", highlight=False)
                con.print(f"recommended correction: {correction_call(self.correction)}" if self.correction else
                          "recommended correction: none until the record is fixed", highlight=False)
                return
        print(self.text(), file=stream)

    def save(self, out_dir: str | Path) -> Path:
        """Write ``report.md`` and ``report.json`` to ``out_dir``; returns the markdown path."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(self.json() + "\n")
        path = out / "report.md"
        path.write_text(self.markdown())
        return path


def finite_json(value: object) -> object:
    """``value`` with every non-finite float replaced by ``None`` (JSON ``null``), dict keys as strings, tuples as
    lists and anything else JSON cannot hold (a tensor, a dtype) as its ``str``."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    try:
        num = float(value)  # numpy / torch scalars
    except (TypeError, ValueError):
        return str(value)
    return num if math.isfinite(num) else None
