#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite, slow tests included (the default `pytest` skips them).
# Two test processes more than cores: much of the suite waits on targets that hang, time out or start up, and with one
# process per core a 2-core machine stayed about 20 % idle (BENCHMARKS.md, "Test suite time"). KVFUZZ_TEST_WORKERS
# overrides the count.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
WORKERS=${KVFUZZ_TEST_WORKERS:-$(( $(nproc) + 2 ))}
.venv/bin/python -m pytest -n "$WORKERS" --dist loadfile -q -p no:cacheprovider -m "slow or not slow" tests "$@"
