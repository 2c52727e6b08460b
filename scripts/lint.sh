#!/usr/bin/env bash
# Lint and format check (ruff settings live in pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check powerinfer tests scripts
ruff format --check powerinfer tests scripts
