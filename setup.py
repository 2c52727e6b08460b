"""Build entry for the C kernels only; all metadata lives in pyproject.toml.

The kernels are one shared library, loaded by powerinfer/ops through ctypes. Set POWERINFER_DEBUG_BUILD=1 to
compile without optimisation and with debug symbols.

The flags are the same for every CPU: no -m option is passed. On x86-64 the AVX2 and AVX-512 variants are compiled
through per-function target attributes next to the scalar one (the caller picks one per call); for any other
target (aarch64, ...) the preprocessor leaves them out (PI_X86 in kernels/cpu/common.h), so the scalar kernels build
with any C11 compiler that has OpenMP. scripts/check_aarch64.sh cross-compiles them for aarch64 and tests them there.
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
