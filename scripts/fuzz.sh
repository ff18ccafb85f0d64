#!/usr/bin/env bash
# Set up (if needed) and run a short campaign against the default target (the installed vLLM).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/kvfuzz run --vllm installed --max-time "${KVFUZZ_TIME:-60}" --seed "${KVFUZZ_SEED:-0}" \
  --corpus corpus/findings --report kvfuzz-report.json "$@"
