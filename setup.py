"""Package layout: the library lives in src/offpolicy; the Triton kernels live in the top-level kernels/ folder
and install as the subpackage offpolicy.kernels (pyproject.toml holds all other metadata)."""
from setuptools import find_packages, setup

setup(
    packages=find_packages("src") + ["offpolicy.kernels"],
    package_dir={"": "src", "offpolicy.kernels": "kernels"},
)
