#!/usr/bin/env bash
# Run the kvfuzz selftest on a CUDA machine from a bundle built by scripts/make_gpu_bundle.py: a short
# campaign with the physical probe on every case (every view written and read back on the device),
# then one with the kernel probe (tokens written through each backend's own cache write: Triton
# kernels compiled for the GPU, the compiled ops of an installed CUDA vLLM with --vllm installed)
# and the byte-addressing consumers on every case. The machine needs Python with torch; nothing
# else, and no package index.
#
#   bash gpu_check.sh BUNDLE.tar.gz [selftest options]      e.g. --device cuda --max-time 60
#
# Environment: PYTHON (default python3), KVFUZZ_CHECK_DIR (unpack here and keep it; default a
# temporary folder, removed afterwards), KVFUZZ_CHECK_PROBES (the probes run, in order; default
# "physical kernel"). Exit status: the worst selftest's (0 nothing new found, 1 new findings, 2 setup
# error).
set -euo pipefail

bundle=${1:?usage: gpu_check.sh BUNDLE.tar.gz [--device cuda] [--max-time SECONDS] [selftest options]}
shift
python=${PYTHON:-python3}
# The attention read-back reads FLEX_ATTENTION's forward too (compiled for the device; a campaign on the CPU leaves it
# out, fuzz/checks/attention.py).
export KVFUZZ_READ_FLEX=${KVFUZZ_READ_FLEX:-1}
[[ -f $bundle ]] || { echo "gpu_check: no bundle at $bundle" >&2; exit 2; }
"$python" -c "import torch, numpy" 2>/dev/null || { echo "gpu_check: $python cannot import torch and numpy" >&2; exit 2; }

if [[ -n ${KVFUZZ_CHECK_DIR:-} ]]; then
    work=$KVFUZZ_CHECK_DIR
    mkdir -p "$work"
else
    work=$(mktemp -d "${TMPDIR:-/tmp}/kvfuzz-gpu-check.XXXXXX")
    trap 'rm -rf "$work"' EXIT
fi
tar -xzf "$bundle" -C "$work"

# Unpack the wheels this Python accepts (best tag, then newest, per distribution) into site/, with
# the bundle's own packaging wheel, imported straight from its zip, doing the matching.
"$python" - "$work" <<'PY'
import sys
import zipfile
from pathlib import Path

work = Path(sys.argv[1])
wheels = sorted((work / "wheels").glob("*.whl"))
sys.path.insert(0, str(next(w for w in wheels if w.name.startswith("packaging-"))))
from email.parser import HeaderParser

from packaging.specifiers import SpecifierSet
from packaging.tags import sys_tags
from packaging.utils import parse_wheel_filename

rank = {tag: i for i, tag in enumerate(sys_tags())}
here = ".".join(map(str, sys.version_info[:3]))


def requires_python(wheel):
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        return HeaderParser().parsestr(archive.read(metadata).decode()).get("Requires-Python") or ""


best = {}
for wheel in wheels:
    name, version, _, tags = parse_wheel_filename(wheel.name)
    score = min((rank[t] for t in tags if t in rank), default=None)
    if score is None or here not in SpecifierSet(requires_python(wheel)):
        continue
    if name not in best or (score, -1) < (best[name][0], 0) or (score == best[name][0] and version > best[name][1]):
        best[name] = (score, version, wheel)
missing = sorted({parse_wheel_filename(w.name)[0] for w in wheels} - set(best))
for _, _, wheel in best.values():
    zipfile.ZipFile(wheel).extractall(work / "site")
print(f"gpu_check: unpacked {len(best)} wheels for Python {sys.version.split()[0]}"
      + (f"; none fits for {', '.join(missing)}" if missing else ""))
PY

export PYTHONPATH="$work/stubs:$work/kvfuzz:$work/vllm:$work/site${PYTHONPATH:+:$PYTHONPATH}"
# The tree has no package metadata and no compiled ops: let vLLM configure itself as a CPU build;
# kvfuzz still allocates the KV cache on the device it is given.
export VLLM_TARGET_DEVICE=${VLLM_TARGET_DEVICE:-cpu}
export VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-ERROR}
cd "$work/kvfuzz"
manifest=$("$python" -c "import json,sys; print(json.load(open(sys.argv[1]))['vllm'])" "$work/manifest.json")
echo "gpu_check: bundle holds $manifest; python $("$python" -c 'import sys; print(sys.version.split()[0])')"
worst=0
for probe in ${KVFUZZ_CHECK_PROBES:-physical kernel}; do
    set +e
    "$python" -m fuzz.campaign.selftest --probe "$probe" "$@"
    status=$?
    set -e
    (( status > worst )) && worst=$status
done
exit $worst
