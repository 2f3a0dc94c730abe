#!/usr/bin/env bash
# GPU readiness check: run from the repo root on a machine with GPUs and the project installed.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-.venv/bin/python}" scripts/gpu_check.py "$@"
