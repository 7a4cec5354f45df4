"""Runs tests/adapters/test_trust_region_cases.py (op.TrustRegion against verl's dppo_tv / dppo_kl and SkyRL's
dppo) inside .venv-trainers; see tests/adapters/test_verl.py for the venv and the opt-out."""

from test_verl import run_in_trainers_venv


def test_trust_region_against_verl_and_skyrl_in_their_venv():
    run_in_trainers_venv("test_trust_region_cases.py")
