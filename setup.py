"""Build entry for the C kernels only; all metadata lives in pyproject.toml.

The kernels are one shared library, loaded by powerinfer/ops through ctypes. Set POWERINFER_DEBUG_BUILD=1 to
compile without optimisation and with debug symbols.
"""

import os
from glob import glob

from setuptools import Extension, setup

debug = os.environ.get("POWERINFER_DEBUG_BUILD", "") not in ("", "0")
compile_args = ["-std=c11", "-fopenmp", "-ffp-contract=off", "-fvisibility=hidden", "-Wall", "-Wextra"]
compile_args += ["-O0", "-g"] if debug else ["-O3"]

kernels = Extension(
    "powerinfer._kernels",
    sources=["kernels/bindings.c", *sorted(glob("kernels/cpu/*.c"))],
    depends=sorted(glob("kernels/cpu/*.h")),
    include_dirs=["kernels/cpu"],
    extra_compile_args=compile_args,
    extra_link_args=["-fopenmp"],
    libraries=["m"],
)

setup(ext_modules=[kernels])
