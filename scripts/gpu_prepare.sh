#!/usr/bin/env bash
# Fill wheelhouse/ (git-ignored) for scripts/gpu_check.sh on a GPU machine without network (docs/gpu.md):
#   - wheels for CPython 3.12 on manylinux x86_64 of what the check imports beyond torch and triton (ROOTS below
#     and their dependencies), at the versions installed here;
#   - the C kernels built here, as wheelhouse/kernels/_kernels.so with the hash of their sources, which the
#     check uses instead of building them (~70 s) when the sources still hash the same. They are loaded through
#     ctypes, so the Python version they were built with does not matter.
# Usage: scripts/gpu_prepare.sh [--transformers]
#   --transformers   also transformers and its dependencies (~52 MiB in all): the CUDA tests that compare with it
#                    are skipped without it.
# Env: GPU_PYTHON_VERSION (default 3.12), PYTHON (default python).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
PYVER=${GPU_PYTHON_VERSION:-3.12}
ABI=cp${PYVER/./}
DIR=wheelhouse

# the roots: what `main`, `bench`, the synthetic-model scripts and the CUDA tests import beyond torch and triton
# (pyproject.toml's dependencies less the server's, pytest and psutil of dev); numpy is installed there only when
# the machine has none
ROOTS=(numpy gguf sentencepiece tokenizers safetensors typer rich pytest psutil)
# never carried: torch and what comes with it; imported only to download (gguf's requests, tokenizers' hub)
SKIP=(torch triton setuptools requests huggingface-hub)
if [ "${1:-}" = "--transformers" ]; then
  ROOTS+=(transformers)
  SKIP=(torch triton setuptools)
elif [ -n "${1:-}" ]; then
  sed -n '2,13p' "$0"
  exit 2
fi

# the roots and their dependencies for that Python on Linux, at the versions installed here (the combination
# the tests passed with); read from the installed packages' metadata
mapfile -t SPECS < <("$PY" - "$PYVER" "${ROOTS[*]}" "${SKIP[*]}" <<'PY'
import re
import sys
from importlib import metadata

from packaging.requirements import Requirement

version, roots, skip = sys.argv[1], sys.argv[2].split(), set(sys.argv[3].split())
env = {"python_version": version, "python_full_version": version + ".0", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
       "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
seen: dict[str, str | None] = {}
todo = list(roots)
while todo:
    name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
    if name in seen or name in skip or name.startswith("nvidia-"):
        continue
    try:
        seen[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        seen[name] = None
        print(f"{name} is not installed here: its dependencies are not carried", file=sys.stderr)
        continue
    for text in metadata.requires(name) or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate(env):
            todo.append(req.name)
for name, have in sorted(seen.items()):
    print(name if have is None else f"{name}=={have}")
PY
)
rm -rf "$DIR"
mkdir -p "$DIR/kernels"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --abi "$ABI" --abi abi3 --abi none --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
  --platform any -d "$DIR" "${SPECS[@]}"

# the kernels: rebuilt here when a source is newer than the built library
SRC_HASH=$(find kernels setup.py -type f \( -name '*.c' -o -name '*.h' -o -name '*.py' \) | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -d' ' -f1)
SO=$(ls powerinfer/_kernels*.so 2>/dev/null | head -1 || true)
if [ -z "$SO" ] || [ -n "$(find kernels setup.py -newer "$SO" -type f | head -1)" ]; then
  echo "building the C kernels (a few minutes on 2 cores)"
  "$PY" setup.py -q build_ext --inplace > /dev/null
  SO=$(ls -t powerinfer/_kernels*.so | head -1)
fi
cp "$SO" "$DIR/kernels/_kernels.so"
strip --strip-unneeded "$DIR/kernels/_kernels.so" 2> /dev/null || true
echo "$SRC_HASH" > "$DIR/kernels/sources.sha256"
# the commit the check runs on, for its table (the GPU machine gets the work tree without .git)
if TREE=$(git rev-parse --short HEAD 2> /dev/null); then
  git diff --quiet HEAD -- . ':!wheelhouse' || TREE="$TREE (uncommitted changes)"
else
  TREE=unknown
fi
echo "$TREE" > "$DIR/tree.txt"

# the wheels must install for that Python and platform
SITE=$(mktemp -d)
"$PY" -m pip install -q --no-index --no-deps --no-compile --only-binary=:all: --python-version "$PYVER" \
  --implementation cp --abi "$ABI" --abi abi3 --abi none --platform manylinux2014_x86_64 \
  --platform manylinux_2_28_x86_64 --platform any \
  --target "$SITE" "$DIR"/*.whl
rm -rf "$SITE"

ls -l "$DIR" "$DIR/kernels" | awk 'NF > 5 {printf "%10d  %s\n", $5, $NF}'
echo "wheelhouse: $(du -sm "$DIR" | cut -f1) MiB, $(ls "$DIR"/*.whl | wc -l) wheels for CPython $PYVER; kernels from $SO"
