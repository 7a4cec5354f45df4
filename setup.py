"""Package layout: the library lives in src/offpolicy; the kernels (Triton, and the C source of the CPU loops, which
is compiled at first use) live in the top-level kernels/ folder and install as the subpackage offpolicy.kernels
(pyproject.toml holds all other metadata).

kernels/ is not a package (no ``__init__.py``, so that a checkout's root on ``sys.path`` never shadows another
top-level ``kernels``); ``offpolicy.kernels``'s ``__init__.py`` is src/offpolicy/kernels/__init__.py. In a checkout
that file extends the package's ``__path__`` to kernels/; for a wheel, the build below installs kernels/'s modules
and C source beside it: the package's folder is kernels/ (so its modules and package data come from there) and its
``__init__.py`` comes from src/."""

import os

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

KERNELS_PACKAGE = "offpolicy.kernels"
KERNELS_INIT = os.path.join("src", "offpolicy", "kernels", "__init__.py")


class BuildPy(build_py):
    """build_py that takes ``offpolicy.kernels``'s ``__init__.py`` from src/ and its other files from kernels/."""

    def check_package(self, package, package_dir):
        if package == KERNELS_PACKAGE:
            return KERNELS_INIT  # kernels/ holds no __init__.py on purpose
        return super().check_package(package, package_dir)

    def find_package_modules(self, package, package_dir):
        modules = super().find_package_modules(package, package_dir)
        if package == KERNELS_PACKAGE:
            modules = [m for m in modules if m[1] != "__init__"] + [(package, "__init__", KERNELS_INIT)]
        return modules


setup(
    packages=sorted(set(find_packages("src")) | {KERNELS_PACKAGE}),
    package_dir={"": "src", KERNELS_PACKAGE: "kernels"},
    package_data={KERNELS_PACKAGE: ["*.c"]},
    # Only the package data named above: src/ holds no other data, and the manifest's view of
    # src/offpolicy/kernels/__init__.py (a module of offpolicy.kernels, whose folder is kernels/) would otherwise
    # read it as data of offpolicy and warn that offpolicy.kernels is not packaged.
    include_package_data=False,
    cmdclass={"build_py": BuildPy},
)
