"""The README's quickstart runs, and .ci/run runs the README's test command (so they cannot drift apart)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_readme_quickstart_runs():
    text = (ROOT / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert namespace["out"].loss.requires_grad is False or namespace["logits"].grad is not None


def test_ci_runs_the_readme_test_command():
    text = (ROOT / "README.md").read_text()
    assert re.search(r"<!-- test-command -->\n```bash\n.+pytest.*\n```\n<!-- /test-command -->", text)
    assert re.search(r"<!-- main-command -->\n```bash\n.+\n```\n<!-- /main-command -->", text)
    ci = (ROOT / ".ci" / "run").read_text()
    assert "test-command" in ci and "README.md" in ci


def test_import_and_cpu_loss_without_triton():
    """`import offpolicy` and the CPU path work where Triton is absent (simulated by blocking its import)."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, offpolicy as op\n"
        "z = torch.randn(4, 10, requires_grad=True)\n"
        "out = op.policy_loss(z, torch.tensor([1, 2, 3, 4]), torch.full((4,), -2.0), torch.randn(4),\n"
        "                     correction=op.Correction(weights='mis'))\n"
        "out.loss.backward(); assert z.grad is not None and torch.isfinite(out.loss)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)


def test_the_library_needs_only_its_declared_dependencies():
    """The core, the fleet and the adapters import and compute without the packages pyproject.toml no longer
    requires (numpy, einops, jaxtyping; their imports are blocked), and pyproject.toml requires nothing else."""
    import subprocess
    import sys
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert sorted(re.split(r"[<>=;\s]", d)[0] for d in deps) == ["torch", "triton"]
    code = (
        "import sys\n"
        "for name in ('numpy', 'einops', 'jaxtyping'): sys.modules[name] = None\n"
        "import torch, offpolicy as op\n"
        "import offpolicy.reference, offpolicy.fleet, offpolicy.fleet.sampler, offpolicy.adapters.sglang\n"
        "from offpolicy.fleet.quant import quantize, dequantize\n"
        "x = torch.randn(4, 32)\n"
        "assert dequantize(quantize(x, 'nvfp4')).shape == x.shape\n"
        "z = torch.randn(4, 10, requires_grad=True)\n"
        "head = op.Candidates(torch.tensor([[1], [2], [3], [4]]), torch.full((4, 1), -2.0), 'head')\n"
        "out = op.policy_loss(z, torch.tensor([1, 2, 3, 4]), torch.full((4,), -2.0), torch.randn(4), head,\n"
        "                     correction=op.Correction(weights='mis', score_centering=True))\n"
        "out.loss.backward(); assert z.grad is not None and torch.isfinite(out.loss)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)


def test_architecture_page_lists_every_top_level_part_in_its_layer_table():
    """docs/architecture.md's layer table names every top-level module and subpackage of ``offpolicy`` and the
    kernels folder, so the page cannot fall behind the folders (tests/project/test_layers.py checks the imports)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## The layers", 1)[1].split("\n## ", 1)[0]
    table = "\n".join(line for line in section.splitlines() if line.startswith("|"))
    named = set(re.findall(r"`(?:src/offpolicy/)?([\w]+)(?:/|\.py)`", table))
    src = ROOT / "src" / "offpolicy"
    parts = {p.stem for p in src.glob("*.py")} | {p.name for p in src.iterdir() if (p / "__init__.py").exists()}
    assert (ROOT / "kernels").is_dir() and "kernels" in named
    assert parts <= named, f"parts missing from the layer table of docs/architecture.md: {sorted(parts - named)}"


def test_the_docs_install_only_declared_extras():
    """Every extra a pip command in README.md or docs/*.md names (``.[test,demo]``, ``offpolicy[test]``) is one that
    pyproject.toml declares, so the README's set-up (the CI test command) cannot name a renamed extra."""
    import tomllib

    declared = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    named = set()
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for group in re.findall(r"(?:\.|offpolicy)\[([\w,-]+)\]", doc.read_text(encoding="utf-8")):
            named |= set(group.split(","))
    assert {"test", "demo"} <= named
    assert named <= declared, f"extras named in the docs but not declared in pyproject.toml: {sorted(named - declared)}"
