"""The demo's warm-up cache lives under the library's one cache variable, ``$OFFPOLICY_CACHE_DIR/demo``; the former
``OFFPOLICY_CACHE`` is honoured with a warning, so that nobody's cache moves silently."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from offpolicy.demo import warmup


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("OFFPOLICY_CACHE", raising=False)
    monkeypatch.delenv("OFFPOLICY_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    warmup._warn_old_variable.cache_clear()
    yield
    warmup._warn_old_variable.cache_clear()


def test_default_is_the_cache_root_s_demo_folder(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warmup.default_cache_dir() == tmp_path / "home" / ".cache" / "offpolicy" / "demo"


def test_offpolicy_cache_dir_moves_it(monkeypatch, tmp_path):
    monkeypatch.setenv("OFFPOLICY_CACHE_DIR", str(tmp_path / "root"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warmup.default_cache_dir() == tmp_path / "root" / "demo"


def test_the_former_variable_is_honoured_with_one_warning(monkeypatch, tmp_path):
    monkeypatch.setenv("OFFPOLICY_CACHE", str(tmp_path / "old"))
    monkeypatch.setenv("OFFPOLICY_CACHE_DIR", str(tmp_path / "root"))
    with pytest.warns(FutureWarning, match="set OFFPOLICY_CACHE_DIR instead") as caught:
        assert warmup.default_cache_dir() == Path(tmp_path / "old")
        assert warmup.default_cache_dir() == Path(tmp_path / "old")
    assert len([w for w in caught if issubclass(w.category, FutureWarning)]) == 1
