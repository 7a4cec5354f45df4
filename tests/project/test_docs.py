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
