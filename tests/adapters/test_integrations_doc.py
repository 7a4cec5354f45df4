"""docs/integrations.md and the README say, per adapter, what it is tested against: installed trainers where they
install, a transcription of the contract where they do not. The claims about what is (not) installed are checked
against this environment."""

import importlib.metadata
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _rows() -> dict[str, str]:
    """docs/integrations.md's trainer table: trainer -> its 'tested against' cell."""
    text = (ROOT / "docs" / "integrations.md").read_text()
    table = text[text.index("| trainer | adapter |"):].split("\n\n", 1)[0].splitlines()[2:]
    return {row.split("|")[1].strip(): row.split("|")[5].strip() for row in table}


def test_every_trainer_adapter_says_what_it_is_tested_against():
    rows = _rows()
    assert set(rows) == {"TRL 1.16", "verl 0.9.1", "slime / Miles", "SkyRL 0.3", "prime-rl"}
    for name in ("slime / Miles", "prime-rl"):  # neither installs here: a transcription of their contracts
        assert rows[name].startswith("NOT installed") and "transcription" in rows[name], rows[name]
    for name, version in (("TRL 1.16", "1.16.0"), ("verl 0.9.1", "0.9.1"), ("SkyRL 0.3", "0.3.0")):
        assert f"{version} installed" in rows[name], rows[name]
    readme = (ROOT / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| `offpolicy.adapters.trl`"))
    assert "NOT installed" in row and "transcription" in row and "run against the installed trainer" not in row


@pytest.mark.parametrize("module", ["slime", "prime_rl"])
def test_the_transcribed_trainers_are_indeed_not_installed(module):
    assert importlib.util.find_spec(module) is None


def test_trl_is_the_installed_version_the_docs_name():
    assert importlib.metadata.version("trl") == "1.16.0"
