"""The repository answers to its own spec: docs/spec.md.

* Every citation ``spec.md#<anchor>`` (or ``docs/spec.md#<anchor>``) in the code, tests, docs, examples and benchmarks
  names an anchor that docs/spec.md defines with an explicit ``<a id="..."></a>`` tag.
* Nothing cites a document outside the repository (the project's old upper-case spec name, a shared folder, the
  research write-up by its file name or as "the seed").
* Every relative link in the Markdown docs and the README points at a file that exists (and, with a ``#fragment``,
  at an anchor or heading of that file).

Each check is a plain function of a text, so that a test can feed it a bad sample and see it fail.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "docs" / "spec.md"
SCANNED = ("src", "kernels", "tests", "docs", "examples", "benchmarks")
SKIPPED_DIRS = {".git", "__pycache__", ".pytest_cache", ".hypothesis", ".benchmarks", "node_modules"}

ANCHOR_TAG = re.compile(r'<a id="([^"]+)"></a>')
SPEC_CITATION = re.compile(r"(?<![\w.-])(?:[\w.-]+/)*spec\.md#([A-Za-z0-9_-]+)")
# A document outside the repository: the old spec by its upper-case name ("<name> section 3", "<name> 7.2"), any
# path into the shared folder, the research write-up's file name, and the phrase for that write-up.
OUTSIDE_CITATIONS = (
    ("the old spec by name", re.compile(r"\bSPEC\b")),
    ("a shared/ path", re.compile(r"shared/")),
    ("the write-up's file", re.compile(r"seed/0")),
    ("'the seed'", re.compile(r"\bthe seed\b", re.IGNORECASE)),
)
MD_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def spec_anchors(text: str) -> set[str]:
    """The explicit anchors a Markdown text defines."""
    return set(ANCHOR_TAG.findall(text))


def unknown_spec_anchors(text: str, anchors: set[str]) -> list[str]:
    """Anchors cited as ``spec.md#<anchor>`` in ``text`` that are not in ``anchors``."""
    return [a for a in SPEC_CITATION.findall(text) if a not in anchors]


def outside_citations(text: str) -> list[str]:
    """``"line N: what"`` for every citation of a document outside the repository."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for what, pattern in OUTSIDE_CITATIONS:
            if pattern.search(line):
                found.append(f"line {number}: {what}: {line.strip()[:120]}")
    return found


def heading_slugs(text: str) -> set[str]:
    """GitHub's anchors for the headings of a Markdown text (lower case, punctuation dropped, spaces to dashes,
    repeats numbered), plus its explicit anchors."""
    slugs: set[str] = set()
    seen: dict[str, int] = {}
    in_code = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        m = None if in_code else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
            n = seen.get(base, 0)
            seen[base] = n + 1
            slugs.add(base if n == 0 else f"{base}-{n}")
    return slugs | spec_anchors(text)


def broken_links(text: str, where: Path) -> list[str]:
    """Relative links in the Markdown ``text`` of the file ``where`` whose target file (or anchor) is missing."""
    bad = []
    for target in MD_LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto: ...
            continue
        path, _, fragment = target.partition("#")
        dest = where if not path else (where.parent / path)
        if not dest.exists():
            bad.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
            continue
        if fragment and dest.suffix == ".md" and fragment not in heading_slugs(dest.read_text(encoding="utf-8")):
            bad.append(f"{target}: no anchor #{fragment} in {dest.name}")
    return bad


def _read_text(path: Path) -> str | None:
    """The file's text, or None for a binary (a NUL byte, or not UTF-8)."""
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _scanned():
    """``(path, text)`` of the README and every text file under the scanned folders (not virtual envs, caches or
    build output)."""
    paths = [ROOT / "README.md"]
    for top in SCANNED:
        paths += [p for p in sorted((ROOT / top).rglob("*")) if p.is_file() and not any(
            part in SKIPPED_DIRS or part.startswith(".venv") or part.endswith(".egg-info")
            for part in p.relative_to(ROOT).parts)]
    for path in paths:
        text = _read_text(path)
        if text is not None:
            yield path, text


def _scanned_but_this_file():
    """The scan without this file, whose own samples are bad on purpose."""
    me = Path(__file__).resolve()
    return ((p, text) for p, text in _scanned() if p.resolve() != me)


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_spec_defines_the_cited_anchors():
    text = SPEC.read_text(encoding="utf-8")
    anchors = spec_anchors(text)
    repeated = sorted(a for a in anchors if ANCHOR_TAG.findall(text).count(a) > 1)
    assert not repeated, f"anchors defined twice in docs/spec.md: {repeated}"
    required = {
        "notation", "records", "weights", "score-centering", "mask-replay", "family", "sequence-level", "veto",
        "kl-rejection", "opsm", "batch-normalization", "decoupled-ppo", "aggregation", "advantages", "metrics",
        "invariants", "inv-zero-drift", "inv-head-exact", "inv-plain-is", "inv-support", "inv-autograd",
        "inv-masking", "inv-sharding", "inv-hostile", "performance", "api", "sources",
    }
    assert required <= anchors, f"docs/spec.md lacks anchors {sorted(required - anchors)}"


def test_every_spec_citation_names_an_existing_anchor():
    anchors = spec_anchors(SPEC.read_text(encoding="utf-8"))
    bad = [f"{_rel(p)}: #{a}" for p, text in _scanned_but_this_file() for a in unknown_spec_anchors(text, anchors)]
    assert not bad, "citations of anchors that docs/spec.md does not define:\n" + "\n".join(bad)


def test_nothing_cites_a_document_outside_the_repository():
    bad = [f"{_rel(p)} {hit}" for p, text in _scanned_but_this_file() for hit in outside_citations(text)]
    assert not bad, (
        "citations of documents outside the repository (cite docs/spec.md#<anchor>, and the study by name, "
        "spec.md#sources):\n" + "\n".join(bad)
    )


def test_relative_links_in_the_docs_point_at_files():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    bad = [f"{_rel(p)}: {b}" for p in pages for b in broken_links(p.read_text(encoding="utf-8"), p)]
    assert not bad, "broken relative links:\n" + "\n".join(bad)


def test_the_scan_covers_the_tree():
    """The walk reaches code, tests, docs and the README, and leaves out binary files."""
    seen = {_rel(p) for p, _ in _scanned()}
    for must in ("README.md", "docs/spec.md", "src/offpolicy/__init__.py", "kernels/logsoftmax.py",
                 "tests/project/test_spec.py", "examples/qwen3_quickstart.py", "benchmarks/bench_cpu.py"):
        assert must in seen, must
    assert not any(s.endswith(".png") for s in seen)


# The checks can fail: each is fed a bad sample.

@pytest.mark.parametrize("sample", ["see docs/spec.md#no-such-anchor", "(spec.md#weightz)", "`spec.md#inv-7`",
                                    "[x](../docs/spec.md#nope)"])
def test_unknown_anchor_is_reported(sample):
    anchors = spec_anchors('<a id="weights"></a>\n<a id="inv-zero-drift"></a>')
    assert unknown_spec_anchors(sample, anchors) != []
    assert unknown_spec_anchors("docs/spec.md#weights and spec.md#inv-zero-drift", anchors) == []
    assert unknown_spec_anchors("myspec.md#nope, the OCP spec, spec.md", anchors) == []


@pytest.mark.parametrize(
    "sample",
    [
        "the weight of " + "SP" + "EC section 2",
        "(" + "SP" + "EC 7.2, 7.5)",
        "as in " + "/work/" + "shared/SPEC.md",
        "see " + "seed/" + "000_d4597ea339f8e7b2.txt",
        "as in " + "the" + " seed's runs",
        "The" + " Seed write-up",
    ],
)
def test_outside_citation_is_reported(sample):
    assert outside_citations("fine line\n" + sample) and outside_citations(sample)[0].startswith("line 1:")


@pytest.mark.parametrize("sample", ["a seeded generator", "seed_fleet()", "the OCP MX spec, section 6.3",
                                    "torch.manual_seed(0)", "spec.md#weights", "the seeds of the runs"])
def test_ordinary_text_is_not_reported(sample):
    assert outside_citations(sample) == []


def test_broken_link_is_reported(tmp_path):
    page = ROOT / "docs" / "README.md"
    assert broken_links("[x](no_such_page.md)", page)
    assert broken_links("[x](spec.md#no-such-anchor)", page)
    assert broken_links("![plot](img/missing.png)", page)
    assert broken_links("[x](spec.md#weights) [y](https://example.org/a.md) [z](math.md#numerics)", page) == []


def test_heading_slugs_follow_github():
    text = "# A `code` title: 2.1\n## Same\n## Same\n```\n# not a heading\n```\n"
    assert heading_slugs(text) == {"a-code-title-21", "same", "same-1"}
