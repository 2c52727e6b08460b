#!/usr/bin/env bash
# Issue 47's GPU check in one run of at most ~6 minutes on a fresh CUDA machine without network (docs/gpu.md):
# install the wheels of wheelhouse/ (scripts/gpu_prepare.sh, run beforehand where there is network), use the
# carried C kernels or build them, `pytest -m cuda`, make the synthetic 1.1B Q4_0 PowerInfer model and its dense
# twin, time `powerinfer bench` CPU only, with the pool and with -ngl, compare greedy `main` output, decode four
# sequences together (`powerinfer batched`, the batch span), run scripts/bench_pool_kernels.py, then print the
# acceptance table (scripts/gpu_table.py) and write it to $OUT/table.md. Every step has its own timeout and its log in $OUT; a failing step never stops the rest.
# Without CUDA the steps that need it print "skipped: no CUDA" and their cells are "-".
#
# Env: OUT (default ./gpu_results), PYTHON (default python3), GPU_CHECK_BUDGET_S (whole run, default 350),
#   GPU_CHECK_THREADS (default all cores), GPU_CHECK_SHAPE (make_synthetic_model.py --shape: tinyllama-1.1b,
#   or tiny for a quick dry run), GPU_CHECK_LONG_PROMPT (default 512; 128 for the tiny shape),
#   GPU_CHECK_POOL=cpu (no CUDA: run the pool steps on the CPU stand-in, --pool-device cpu).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
T0=$(date +%s)
DEADLINE=$((T0 + ${GPU_CHECK_BUDGET_S:-350}))
OUT=${OUT:-gpu_results}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}
SHAPE=${GPU_CHECK_SHAPE:-tinyllama-1.1b}
THREADS=${GPU_CHECK_THREADS:-$(nproc)}
if [ "$SHAPE" = tiny ]; then LONG=${GPU_CHECK_LONG_PROMPT:-128}; else LONG=${GPU_CHECK_LONG_PROMPT:-512}; fi
WORK=$(mktemp -d)
STEPS=$OUT/steps.tsv
: > "$STEPS"
rm -f "$OUT"/bench_*.jsonl "$OUT"/main_*.txt "$OUT"/cuda_tests.txt "$OUT"/bench_pool_kernels.txt "$OUT"/table.md

say() { echo "=== [$(($(date +%s) - T0))s] $*"; }
note() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >> "$STEPS"; say "$1: $4 (${3}s)"; }

# step NAME LIMIT STDOUT CMD...: CMD under `timeout` (LIMIT seconds, less when the run's deadline is nearer; 10 s
# are kept for the table), stdout to STDOUT, stderr to $OUT/NAME.log; records exit code and seconds
step() {
  local name=$1 limit=$2 stdout=$3 log=$OUT/$1.log
  shift 3
  local left=$((DEADLINE - $(date +%s) - 10))
  ((limit > left)) && limit=$left
  if ((limit < 5)); then
    note "$name" - 0 "skipped: out of time"
    return 1
  fi
  local t rc
  t=$(date +%s)
  if [ "$stdout" = "$log" ]; then
    timeout -k 5 "$limit" "$@" > "$log" 2>&1
  else
    timeout -k 5 "$limit" "$@" > "$stdout" 2> "$log"
  fi
  rc=$?
  local took=$(($(date +%s) - t)) what="ok" last
  last=$(tail -n 1 "$log")
  [ -z "$last" ] && last=$(tail -n 1 "$stdout")  # pytest says why on stdout
  ((rc == 124 || rc == 137)) && what="timed out after ${limit}s"
  ((rc != 0 && rc != 124 && rc != 137)) && what="failed (exit $rc): ${last:0:150}"
  note "$name" "$rc" "$took" "$what"
  return $rc
}

# ------------------------------------------------------------------------------------------ dependencies
# the wheels go in when they were made for this Python (the tested set, whatever the machine has), or when a
# package is missing
SITE=
TAG=$(timeout 30 "$PY" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
if ! ls wheelhouse/*.whl > /dev/null 2>&1; then
  if timeout 60 "$PY" -c "import gguf, sentencepiece, typer, rich, pytest, yaml, tqdm" 2> /dev/null; then
    note install - 0 "skipped: no wheelhouse/, the packages are there"
  else
    note install - 0 "missing packages and no wheelhouse/ (scripts/gpu_prepare.sh makes it)"
  fi
elif ls wheelhouse/*-"$TAG"-*.whl > /dev/null 2>&1 \
  || ! timeout 60 "$PY" -c "import gguf, sentencepiece, typer, rich, pytest, yaml, tqdm" 2> /dev/null; then
  SITE=$WORK/site
  WHEELS=()
  for w in wheelhouse/*.whl; do
    # the machine's own numpy, if it has one, stays (its torch was built with it)
    case $(basename "$w") in numpy-*) timeout 60 "$PY" -c "import numpy" 2> /dev/null && continue ;; esac
    WHEELS+=("$w")
  done
  step install 120 "$OUT/install.log" "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --disable-pip-version-check --target "$SITE" "${WHEELS[@]}"
else
  note install - 0 "skipped: wheelhouse/ is for another Python, the packages are there"
fi
export PYTHONPATH=$ROOT${SITE:+:$SITE}${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1

# ---------------------------------------------------------------------------------------------- kernels
SRC_HASH=$(find kernels setup.py -type f \( -name '*.c' -o -name '*.h' -o -name '*.py' \) | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -d' ' -f1)
kernels_load() { timeout 60 "$PY" -W ignore -c "from powerinfer.ops import library; raise SystemExit(library.load() is None)" 2> /dev/null; }
SUFFIX=$(timeout 30 "$PY" -c "import importlib.machinery as m; print(m.EXTENSION_SUFFIXES[0])")
SO=powerinfer/_kernels$SUFFIX
if [ -f "$SO" ] && { [ "$(cat build/kernels.sha256 2> /dev/null)" = "$SRC_HASH" ] || [ -z "$(find kernels setup.py -newer "$SO" -type f | head -1)" ]; } && kernels_load; then
  note kernels - 0 "present ($SO)"
elif [ -f wheelhouse/kernels/_kernels.so ] && [ "$(cat wheelhouse/kernels/sources.sha256 2> /dev/null)" = "$SRC_HASH" ] \
  && cp wheelhouse/kernels/_kernels.so "$SO" && kernels_load; then
  mkdir -p build && echo "$SRC_HASH" > build/kernels.sha256
  note kernels - 0 "carried (wheelhouse/kernels, same sources)"
else
  rm -f "$SO"
  step build 180 "$OUT/build.log" "$PY" setup.py -q build_ext --inplace --parallel "$THREADS" \
    && mkdir -p build && echo "$SRC_HASH" > build/kernels.sha256
  kernels_load || note kernels - 0 "not loadable: ops run the pure-torch reference"
fi

# ---------------------------------------------------------------------------------------------- machine
# python, torch and Triton versions and whether CUDA is there, in one interpreter start
timeout 60 "$PY" - > "$WORK/versions.env" 2> "$OUT/versions.log" << 'PY'
import platform

print("python=" + platform.python_version())
import torch

print("torch=" + torch.__version__)
print("cuda=" + str(int(torch.cuda.is_available())))
import triton

print("triton=" + triton.__version__)
PY
CUDA=0
grep -q '^cuda=1$' "$WORK/versions.env" && CUDA=1
if ((CUDA)); then POOL=cuda; elif [ "${GPU_CHECK_POOL:-}" = cpu ]; then POOL=cpu; else POOL=none; fi
if TREE=$(git rev-parse --short HEAD 2> /dev/null); then
  git diff --quiet HEAD 2> /dev/null || TREE="$TREE (uncommitted changes)"
else  # a copy of the work tree without .git: the commit gpu_prepare.sh recorded
  TREE=$(cat wheelhouse/tree.txt 2> /dev/null || echo unknown)
fi
{
  echo "date=$(date -u +%Y-%m-%d)"
  echo "tree=$TREE"
  echo "gpu=$(timeout 30 nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2> /dev/null | head -1)"
  echo "cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')"
  echo "cores=$(nproc)"
  grep -v '^cuda=' "$WORK/versions.env"
  echo "shape=$SHAPE"
  echo "threads=$THREADS"
  echo "long_prompt=$LONG"
  echo "pool=$POOL"
} > "$OUT/meta.env"
sed -i 's/^gpu=$/gpu=no GPU/' "$OUT/meta.env"
timeout 30 nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
say "machine: $(tr '\n' ' ' < "$OUT/meta.env")"

# ------------------------------------------------------------- CUDA tests, beside the model's making
PYTEST_PID=
if ((CUDA)); then
  mapfile -t CUDA_FILES < <(grep -l "mark\.cuda" tests/test_*.py)
  PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 step pytest_cuda 170 "$OUT/cuda_tests.txt" "$PY" -m pytest -v -p no:cacheprovider -m cuda "${CUDA_FILES[@]}" &
  PYTEST_PID=$!
else
  note pytest_cuda - 0 "skipped: no CUDA"
fi

SYN=$WORK/syn
step synthetic 150 "$OUT/synthetic.log" "$PY" scripts/make_synthetic_model.py --out "$SYN" --types q4_0 --shape "$SHAPE" -q
SPARSE=$(ls "$SYN"/synthetic-*.q4.powerinfer.gguf 2> /dev/null | head -1)
DENSE=$SYN/dense.q4.gguf
if [ -n "$SPARSE" ]; then
  step dense_twin 90 "$OUT/dense_twin.log" "$PY" scripts/pwri_to_dense.py "$SPARSE" "$DENSE"
else
  note dense_twin - 0 "skipped: no synthetic model"
fi
[ -n "$PYTEST_PID" ] && wait "$PYTEST_PID"

# ------------------------------------------------------------------------------------------- benches
# bench RUN MODEL NEEDS_POOL EXTRA...: powerinfer bench -o jsonl into $OUT/bench_RUN.jsonl
bench() {
  local run=$1 model=$2 pool=$3
  shift 3
  if [ ! -f "$model" ]; then
    note "bench_$run" - 0 "skipped: no model"
  elif ((pool)) && [ "$POOL" = none ]; then
    note "bench_$run" - 0 "skipped: no CUDA"
  else
    local flags=()
    ((pool)) && flags=(--pool-device "$POOL")
    step "bench_$run" 100 "$OUT/bench_$run.jsonl" "$PY" -m powerinfer bench -m "$model" -r 3 -t "$THREADS" \
      -o jsonl "${flags[@]}" "$@"
  fi
}
bench cpu "$SPARSE" 0 -p 64 -n 64
bench vb0 "$SPARSE" 1 -p 64 -n 64 --vram-budget 0
bench vb2 "$SPARSE" 1 -p "64,$LONG" -n 64 --vram-budget 2
bench vb025 "$SPARSE" 1 -p 64 -n 64 --vram-budget 0.25
bench dense_cpu "$DENSE" 0 -p 64 -n 64
bench ngl99 "$DENSE" 1 -p "64,$LONG" -n 64 -ngl 99
bench ngl9 "$DENSE" 1 -p 64 -n 64 -ngl 9

# -------------------------------------------------------------------------------------------- greedy
# greedy RUN MODEL NEEDS_POOL EXTRA...: main's text into $OUT/main_RUN.txt
greedy() {
  local run=$1 model=$2 pool=$3
  shift 3
  if [ ! -f "$model" ]; then
    note "main_$run" - 0 "skipped: no model"
  elif ((pool)) && [ "$POOL" = none ]; then
    note "main_$run" - 0 "skipped: no CUDA"
  else
    local flags=()
    ((pool)) && flags=(--pool-device "$POOL")
    step "main_$run" 60 "$OUT/main_$run.txt" "$PY" -m powerinfer main -m "$model" -p "The quick brown fox" -n 32 \
      --temp 0 --act-precision f32 -t "$THREADS" "${flags[@]}" "$@"
  fi
}
greedy sparse_cpu "$SPARSE" 0
greedy sparse_vb2 "$SPARSE" 1 --vram-budget 2
greedy sparse_vb025 "$SPARSE" 1 --vram-budget 0.25
greedy dense_cpu "$DENSE" 0
greedy dense_ngl99 "$DENSE" 1 -ngl 99
greedy dense_ngl9 "$DENSE" 1 -ngl 9

# ------------------------------------------------------------------------------------------- batched
# four sequences decoding together: the resident layers' batch span (one graph per batch size), greedy; the
# speed line is in batched_vb2.log
if [ ! -f "$SPARSE" ]; then
  note batched_vb2 - 0 "skipped: no model"
elif [ "$POOL" = none ]; then
  note batched_vb2 - 0 "skipped: no CUDA"
else
  step batched_vb2 45 "$OUT/batched_vb2.txt" "$PY" -m powerinfer batched -m "$SPARSE" -p "The quick brown fox" \
    --parallel 4 --n-len 48 --temp 0 -t "$THREADS" --pool-device "$POOL" --vram-budget 2
fi

# ------------------------------------------------------------------------------------------- kernels
if [ ! -f scripts/bench_pool_kernels.py ]; then
  note bench_pool_kernels - 0 "absent: no scripts/bench_pool_kernels.py"
elif ((CUDA)); then
  step bench_pool_kernels 90 "$OUT/bench_pool_kernels.txt" "$PY" scripts/bench_pool_kernels.py
else
  note bench_pool_kernels - 0 "skipped: no CUDA"
fi

# --------------------------------------------------------------------------------------------- table
note total - $(($(date +%s) - T0)) "seconds in all"
timeout 30 "$PY" scripts/gpu_table.py "$OUT" > "$OUT/table.md"
cat "$OUT/table.md"
rm -rf "$WORK"
