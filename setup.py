"""Package layout: the library lives in src/offpolicy; the kernels (Triton, and the C source of the CPU loops, which
is compiled at first use) live in the top-level kernels/ folder and install as the subpackage offpolicy.kernels
(pyproject.toml holds all other metadata)."""
from setuptools import find_packages, setup

setup(
    packages=find_packages("src") + ["offpolicy.kernels"],
    package_dir={"": "src", "offpolicy.kernels": "kernels"},
    package_data={"offpolicy.kernels": ["*.c"]},
)
