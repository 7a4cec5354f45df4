"""Runs tests/adapters/test_skyrl_cases.py inside .venv-trainers (skyrl 0.3.0 pins transformers<=5.8); see
tests/adapters/test_verl.py for the venv and the opt-out."""

from test_verl import run_in_trainers_venv


def test_skyrl_adapter_in_its_venv():
    run_in_trainers_venv("test_skyrl_cases.py")


def test_skyrl_migration_rows_in_its_venv():
    run_in_trainers_venv("test_skyrl_migrating_cases.py")
