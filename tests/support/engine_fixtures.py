"""The recorded engine requests and responses in ``tests/support/fixtures`` and the fake servers' toy model that
produced the SGLang / vLLM ones (``fixtures/fake_servers.py``, loaded by path: the fixtures folder is data, not a
package)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

FIX = Path(__file__).resolve().parent / "fixtures"

_spec = importlib.util.spec_from_file_location("fake_servers", FIX / "fake_servers.py")
fake = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fake)


def load(name: str):
    """The JSON document ``fixtures/<name>``."""
    return json.loads((FIX / name).read_text())
