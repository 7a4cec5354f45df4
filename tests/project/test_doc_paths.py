"""Docs that cannot go stale: every repository path and every ``offpolicy.*`` name that README.md and docs/*.md
give in backticks resolves in today's tree.

* A backticked token is a path when it has no spaces and either ends in a known extension (optionally followed by
  ``:line``, ``::test`` or ``#anchor``) or has a ``/``. ``<name>`` / ``{name}`` placeholders and ``*`` act as
  globs and need at least one match. A path starting at a top-level entry of the repository (``src/``,
  ``docs/`` ...) must exist there (``offpolicy/...`` means ``src/offpolicy/...``); any other path, a bare file
  name included, must be the tail of some file's or folder's path in the repository (docs name files by their
  base name inside a table that gives the folder).
* A backticked ``offpolicy.a.b`` (or ``op.a.b``, the docs' ``import offpolicy as op``) resolves statically: the
  longest prefix that is a module of src/ (or kernels/, installed as ``offpolicy.kernels``) and, after it, names
  bound at the top level of that module (def, class, assignment, import), then inside a class. Static, so the
  adapters of trainers that live in the side environments (verl, SkyRL) are checked without importing them.

Fenced code blocks are not scanned (tests/project/test_docs.py and test_examples.py run the code the docs show).
Each check is a plain function of a text, so that a test can feed it a bad sample and see it fail.
"""

from __future__ import annotations

import ast
import os
import re
from fnmatch import fnmatch
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIPPED_DIRS = {".git", "__pycache__", ".pytest_cache", ".hypothesis", ".benchmarks", "node_modules", "demo_out"}

EXTENSIONS = ("py", "md", "c", "h", "toml", "json", "jsonl", "sh", "csv", "png", "txt", "yaml", "cfg")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+)`")
PATH_CHARS = re.compile(r"[\w./*<>{}~$-]+(?:(?:::|:|#)[\w.\[\]<>-]+)?")
SUFFIX = re.compile(r"(?:::[\w.\[\]-]+|:\d+(?:-\d+)?|#[\w<>-]+)$")
PLACEHOLDER = re.compile(r"<[^<>/]*>|\{[^{}/]*\}")
NAME = re.compile(r"(?:offpolicy|op)(?:\.[A-Za-z_]\w*)+")

# Paths that are not the repository's, each with its reason.
NOT_REPOSITORY_PATHS = (
    ("the user's home (caches)", re.compile(r"~/")),
    ("an environment variable's folder (caches)", re.compile(r"\$")),
    ("a URL route or an absolute path (engine endpoints)", re.compile(r"/")),
    ("a folder the demo or diagnose writes in the working directory", re.compile(r"\./(?:demo_out|diagnose_out)")),
    ("a peer's source tree (verl, vLLM, SGLang, Miles)", re.compile(r"(?:verl|vllm|srt|miles)/")),
)
# Files named by their base name that live outside the repository, each with its reason.
NOT_REPOSITORY_FILES = {
    "report.md": "diagnose writes it to --out", "report.json": "diagnose writes it to --out",
    "ratio_hist.png": "diagnose writes it to --out", "kl_by_staleness.png": "diagnose writes it to --out",
    "config.json": "a Hugging Face model folder's", "generation_config.json": "a Hugging Face model folder's",
    "mis.py": "Miles' module, named by its base name",
}


def inline_code(text: str) -> list[str]:
    """The backticked tokens of a Markdown text, outside fenced code blocks."""
    return INLINE.findall(FENCE.sub("", text))


def path_of(token: str) -> str | None:
    """The repository path a backticked token names (its ``:line`` / ``::test`` / ``#anchor`` suffix dropped), or
    None when the token is no path: it has a space, or neither a ``/`` nor a known extension, or it is only a name
    part (``_after.json``, ``.jsonl``) or a metric name (``group/{g}/<name>``: no extension, not rooted in the
    repository)."""
    token = token.strip()
    if not PATH_CHARS.fullmatch(token):
        return None
    path = SUFFIX.sub("", token)
    has_extension = re.search(r"\.(?:%s)$" % "|".join(EXTENSIONS), path) is not None
    if not has_extension and "/" not in path:
        return None
    if path.startswith(("_", ".")) and "/" not in path:
        return None
    if not has_extension and not path.endswith("/") and "." not in path.rsplit("/", 1)[-1] and not _rooted(path):
        return None
    return path


def skip_reason(path: str) -> str | None:
    """Why ``path`` is not checked against the repository, or None when it is."""
    for reason, pattern in NOT_REPOSITORY_PATHS:
        if pattern.match(path):
            return reason
    return NOT_REPOSITORY_FILES.get(path)


def _rooted(path: str) -> bool:
    first = path.split("/", 1)[0]
    return first not in ("", ".", "..") and (ROOT / first).exists()


def _repository_paths() -> list[str]:
    """Every file and folder of the repository, relative to its root, ``/``-separated; folders end with ``/``."""
    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS and not d.startswith(".venv") and not d.endswith(
            ".egg-info") and not os.path.islink(os.path.join(folder, d))]
        rel = Path(folder).relative_to(ROOT).as_posix()
        prefix = "" if rel == "." else rel + "/"
        found += [prefix + d + "/" for d in dirs] + [prefix + f for f in files]
    return found


REPOSITORY = _repository_paths()


def resolves(path: str, repository: list[str] = REPOSITORY) -> bool:
    """Whether ``path`` (placeholders and ``*`` as globs) names a file or folder of ``repository`` (a folder only
    when it ends with ``/``)."""
    pattern = PLACEHOLDER.sub("*", path)
    if pattern.startswith("offpolicy/"):
        pattern = "src/" + pattern
    candidates = [p for p in repository if p.endswith("/")] if pattern.endswith("/") else [
        p.rstrip("/") for p in repository]
    if _rooted(pattern):
        return any(fnmatch(p, pattern) for p in candidates)
    return any(fnmatch(p, pattern) or fnmatch(p, "*/" + pattern) for p in candidates)


def stale_paths(text: str, repository: list[str] = REPOSITORY) -> list[str]:
    """The backticked repository paths of a Markdown text that name nothing in ``repository``."""
    bad = []
    for token in inline_code(text):
        path = path_of(token)
        if path is not None and skip_reason(path) is None and not resolves(path, repository):
            bad.append(token)
    return bad


def _module_file(dotted: str) -> Path | None:
    parts = dotted.split(".")
    bases = [(ROOT / "src" / "offpolicy", parts[1:])]
    if parts[:2] == ["offpolicy", "kernels"]:  # src/offpolicy/kernels/__init__.py, its modules in kernels/
        bases.append((ROOT / "kernels", parts[2:]))
    for base, rest in bases:
        for candidate in (base.joinpath(*rest, "__init__.py"), base.joinpath(*rest[:-1], rest[-1] + ".py") if rest
                          else None):
            if candidate is not None and candidate.is_file():
                return candidate
    return None


def _bound_names(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """Names bound at the top of a module or class body, with the statement that binds them."""
    names: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        names[name.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = node
        elif isinstance(node, (ast.If, ast.Try)):
            nested = node.body + node.orelse + [s for h in getattr(node, "handlers", []) for s in h.body]
            names.update(_bound_names(nested))
    return names


def unresolved_name(name: str) -> str | None:
    """None when ``offpolicy.a.b`` (``op.`` for ``offpolicy.``) resolves to a module or a name bound in one (see the
    module docstring); otherwise what is missing."""
    dotted = "offpolicy" + name[len("op"):] if name.startswith("op.") else name
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module = _module_file(".".join(parts[:cut]))
        if module is not None:
            break
    else:
        return f"{name}: no module"
    body = ast.parse(module.read_text(encoding="utf-8")).body
    for i, attribute in enumerate(parts[cut:], cut):
        node = _bound_names(body).get(attribute)
        if node is None:
            return f"{name}: {'.'.join(parts[:i])} binds no {attribute!r} ({module.relative_to(ROOT)})"
        if isinstance(node, (ast.Import, ast.ImportFrom)) or not isinstance(node, ast.ClassDef):
            break  # a re-export or a value: bound, and attributes beyond it are the object's own
        body = node.body
    return None


def unresolved_names(text: str) -> list[str]:
    """What is missing for each backticked ``offpolicy.*`` / ``op.*`` name of a Markdown text."""
    bad = []
    for token in inline_code(text):
        match = NAME.match(token.strip())
        if match:
            problem = unresolved_name(match.group(0))
            if problem:
                bad.append(problem)
    return bad


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_backticked_paths_exist(doc):
    bad = stale_paths(doc.read_text(encoding="utf-8"))
    assert not bad, f"{doc.relative_to(ROOT)} names paths that are not in the repository: {bad}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_backticked_offpolicy_names_resolve(doc):
    bad = unresolved_names(doc.read_text(encoding="utf-8"))
    assert not bad, f"{doc.relative_to(ROOT)} names what the code does not define: {bad}"


def test_the_checks_see_stale_paths_and_names():
    sample = (
        "`src/offpolicy/ops/linear_support.py` and `linear_full.py:12`, `tests/test_sampler.py::test_x`, "
        "`offpolicy.corrections.correction.DEFAULT_BOUNDS`, `op.no_such_function`, `offpolicy.nothing_here`; "
        "fine: `src/offpolicy/adapters/<trainer>.py`, `docs/spec.md#records`, `group/{g}/<name>`, `_after.json`, "
        "`~/.cache/offpolicy/cpu-<uid>`, `verl/trainer/ppo/core_algos.py`, `op.Correction`, "
        "`offpolicy.adapters.verl.GUARD`, `offpolicy.kernels`\n```bash\npython no/such/file.py\n```\n"
    )
    assert stale_paths(sample) == [
        "src/offpolicy/ops/linear_support.py", "linear_full.py:12", "tests/test_sampler.py::test_x"]
    assert [p.split(":")[0] for p in unresolved_names(sample)] == [
        "offpolicy.corrections.correction.DEFAULT_BOUNDS", "op.no_such_function", "offpolicy.nothing_here"]
