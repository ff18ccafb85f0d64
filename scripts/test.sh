#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite, slow tests included (the default `pytest` skips them).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest -n auto --dist loadfile -q -p no:cacheprovider -m "slow or not slow" tests "$@"
