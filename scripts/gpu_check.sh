#!/usr/bin/env bash
# One prepared check for a machine with an NVIDIA GPU: build, CUDA tests, sparse tests, benchmarks.
# Results go to $OUT (default ./gpu_results). The GPU machine may have no network: it needs torch already,
# and the other dependencies either installed or as wheels in ./wheelhouse, made beforehand on a networked machine with
#   pip download --python-version 3.12 --only-binary=:all: -d wheelhouse gguf sentencepiece tokenizers typer rich
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_results}
mkdir -p "$OUT"
{
  date
  nvidia-smi || true
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
} > "$OUT/env.txt" 2>&1

if [ -d wheelhouse ]; then
  python -m pip install --no-index --find-links wheelhouse gguf sentencepiece tokenizers typer rich >> "$OUT/build.log" 2>&1
fi
python -m pip install --no-build-isolation --no-deps -e . >> "$OUT/build.log" 2>&1 || echo "build failed" >> "$OUT/build.log"

timeout 300 python -m pytest -q -rs -m cuda tests > "$OUT/cuda_tests.txt" 2>&1
timeout 300 python -m pytest -q tests/test_sparse.py tests/test_fixture_sparse.py tests/test_ops.py > "$OUT/cpu_tests.txt" 2>&1

SYN=${SYN:-/tmp/powerinfer-synthetic}
if timeout 400 python scripts/make_synthetic_model.py --out "$SYN" --types q4_0 > "$OUT/synthetic.log" 2>&1; then
  timeout 300 python scripts/bench_sparse.py --dir "$SYN" -t 8 --runs 3 > "$OUT/bench_sparse.txt" 2>&1
fi
echo "done: $(date)" >> "$OUT/env.txt"
