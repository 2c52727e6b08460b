#!/usr/bin/env bash
# Run the whole test suite (CPU only; CUDA tests skip themselves without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m pytest -q --durations=25 "$@"
