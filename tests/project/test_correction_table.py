"""The table of corrections (docs/spec.md#correction-table) enumerates the node classes: every class a
``CorrectionTree`` is built from has a row naming it and its module, each node's ``anchor`` resolves to an anchor of
docs/spec.md, and each node that carries a ``source`` names one."""

from __future__ import annotations

import re
from pathlib import Path

import offpolicy.corrections as oc
from offpolicy.corrections.normalisation import NORMALISATION_CLASSES
from offpolicy.corrections.rules import RULE_CLASSES
from offpolicy.corrections.surrogates import SURROGATE_CLASSES
from offpolicy.corrections.weighting import LEVEL_CLASSES, MODE_CLASSES

ROOT = Path(__file__).resolve().parents[2]
spec_md = (ROOT / "docs" / "spec.md").read_text()

NODE_CLASSES = (*MODE_CLASSES, *LEVEL_CLASSES, *RULE_CLASSES, *SURROGATE_CLASSES, *NORMALISATION_CLASSES,
                oc.Weighting, oc.ScoreCentering, oc.TrustRegion, oc.KLPenalty, oc.CorrectionTree)


def table_rows(text: str) -> dict[str, str]:
    """``{node class name: module}`` of the table after the ``correction-table`` anchor."""
    start = text.index('<a id="correction-table"></a>')
    rows = {}
    for line in text[start:].splitlines():
        m = re.match(r"\| `(\w+)` \| `([\w.]+)` \|", line)
        if m:
            rows[m.group(1)] = m.group(2)
        elif rows and not line.startswith("|"):
            break
    return rows


def test_every_node_class_has_a_row_naming_its_module():
    rows = table_rows(spec_md)
    missing = [c.__name__ for c in NODE_CLASSES if c.__name__ not in rows]
    assert not missing, f"node classes without a row in docs/spec.md#correction-table: {missing}"
    wrong = {c.__name__: rows[c.__name__] for c in NODE_CLASSES
             if not c.__module__.endswith("." + rows[c.__name__].removesuffix(".py"))}
    assert not wrong, f"rows naming the wrong module: {wrong}"
    extra = sorted(set(rows) - {c.__name__ for c in NODE_CLASSES})
    assert not extra, f"rows naming no node class: {extra}"


def test_every_public_node_is_exported():
    assert {c.__name__ for c in NODE_CLASSES} <= set(oc.__all__)


def test_anchors_resolve_and_sources_are_given():
    anchors = set(re.findall(r'<a id="([\w-]+)"></a>', spec_md))
    for cls in NODE_CLASSES:
        anchor = getattr(cls, "anchor", None)
        if cls is not oc.CorrectionTree:
            assert anchor, f"{cls.__name__} has no spec anchor"
        if anchor:
            path, _, name = anchor.partition("#")
            assert path == "docs/spec.md" and name in anchors, f"{cls.__name__}.anchor={anchor!r} does not resolve"
        if cls not in (oc.Weighting, oc.CorrectionTree):
            assert getattr(cls, "source", ""), f"{cls.__name__} names no published source"


def test_a_missing_row_is_caught():
    """The check reads the table itself: a table without a row loses that class."""
    assert "MIS" in table_rows(spec_md)
    assert "MIS" not in table_rows(re.sub(r"^\| `MIS` .*\n", "", spec_md, flags=re.M))


def test_the_table_is_derived_from_the_nodes():
    """docs/spec.md's table is what the node classes declare (their keywords, traits, module), line for line:
    :func:`offpolicy.corrections.registry.correction_table` writes it; paste its lines into the spec after a
    change."""
    from offpolicy.corrections.registry import NODE_CLASSES as DERIVED, correction_table

    assert set(DERIVED) == set(NODE_CLASSES)
    derived = correction_table()
    start = spec_md.index('<a id="correction-table"></a>')
    lines = spec_md[start:].splitlines()
    head = lines.index(derived[0])
    in_spec = [line for line in lines[head:head + len(derived) + 1] if line.startswith("|")]
    assert in_spec == derived, "docs/spec.md#correction-table differs from correction_table():\n" + "\n".join(
        f"spec: {a}\nnode: {b}" for a, b in zip(in_spec + [""] * len(derived), derived) if a != b)


def test_a_node_example_joins_the_kit_matrix(monkeypatch):
    """A node class that declares ``example`` (the keywords of one configuration the kit can feed) is in
    ``family_configs`` without a line of the kit changed."""
    from offpolicy.corrections.surrogates import GMPO
    from offpolicy.testing.config import family_configs, node_examples

    declared = {c.surrogate for c in node_examples()}
    assert {"topr", "kimi15", "kl_cov", "clip_cov"} <= declared
    assert "gmpo" not in declared
    monkeypatch.setattr(GMPO, "example", dict(weights="tis", record="head", gmpo=(0.3, 0.3)), raising=False)
    assert "gmpo" in {c.surrogate for c in node_examples()}
    assert sum(c.gmpo == (0.3, 0.3) for c in family_configs()) == 1
