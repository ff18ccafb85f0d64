#!/usr/bin/env bash
# Set up (if needed) and run the test suite, slow tests included (the default `pytest` skips them), but not the `sweep`
# tests: the rest of a sweep whose sample this runs (more releases, longer scenarios; tests/sweep.py).
# `scripts/test.sh --sweep` runs only those; CI runs both.
# Two test processes more than cores: much of the suite waits on targets that hang, time out or start up, and with one
# process per core a 2-core machine stayed about 20 % idle (BENCHMARKS.md, "Test suite time"). KVFUZZ_TEST_WORKERS
# overrides the count.
set -euo pipefail
cd "$(dirname "$0")/.."
tier="not sweep"
if [ "${1:-}" = "--sweep" ]; then tier="sweep"; shift; fi
bash scripts/setup.sh
# The releases the `releases` tests run (every supported one, tests/test_releases.py RELEASES; about 100 MB of wheel each),
# fetched once and in parallel before pytest, each compiled to bytecode as it lands in the kvfuzz cache; one already there
# costs nothing. One that cannot be fetched is one line here, and the tests that need it skip. KVFUZZ_TEST_RELEASES
# overrides the list ("" fetches none).
RELEASES=${KVFUZZ_TEST_RELEASES-$(.venv/bin/python -c 'from tests.test_releases import RELEASES; print(" ".join(RELEASES))')}
began=$(date +%s)
# shellcheck disable=SC2086 # one argument per release
[ -z "$RELEASES" ] || .venv/bin/python -m fuzz.targets.releases $RELEASES
fetched=$(( $(date +%s) - began ))
WORKERS=${KVFUZZ_TEST_WORKERS:-$(( $(nproc) + 2 ))}
began=$(date +%s)
status=0
.venv/bin/python -m pytest -n "$WORKERS" --dist loadfile -q -p no:cacheprovider -m "$tier" tests "$@" || status=$?
echo "kvfuzz: release downloads ${fetched} s, pytest ($tier) $(( $(date +%s) - began )) s"
exit $status
