#!/usr/bin/env bash
# Empty-corpus campaigns, one worker each, all releases at once; then the signatures each met that corpus/findings does
# not hold for that release (a finding to triage: a vLLM bug for FINDINGS.md, or a false alarm to fix in kvfuzz).
# Exits 1 when a campaign met such a signature or a kvfuzz internal error: issue 47's standing check, for CI or a cron.
# Usage: bash scripts/empty_corpus_campaigns.sh [SECONDS] [SEED] [RELEASE...]   (default: 300 s, seed 11, 0.28.0 installed 0.34.0)
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-300}; seed=${2:-11}; shift $(( $# > 2 ? 2 : $# ))
releases=("$@"); [ ${#releases[@]} -gt 0 ] || releases=(0.28.0 installed 0.34.0)
out=$(mktemp -d /tmp/kvfuzz-empty-corpus.XXXX)
for v in "${releases[@]}"; do
  .venv/bin/kvfuzz run --vllm "$v" --device cpu --max-time "$seconds" --seed "$seed" --workers 1 --corpus "$out/$v" \
    --report "$out/$v.json" --quiet > "$out/$v.out" 2>&1 || true &
done
wait
status=0
.venv/bin/python - "$out" "${releases[@]}" <<'PY' || status=$?
import json
import sys
from pathlib import Path

from fuzz.corpus.store import known_signatures

out, releases = Path(sys.argv[1]), sys.argv[2:]
untriaged = False
for spec in releases:
    report = json.loads((out / f"{spec}.json").read_text())
    release = report["target"]["vllm_version"]
    known = known_signatures(Path("corpus/findings"), release)
    found = {f["signature"]: f for f in report["findings"]}
    new = [s for s in found if s not in known]
    print(f"{spec} ({release}): {report['cases']} cases, {len(found)} signatures, {len(new)} not in the corpus for {release}, "
          f"internal errors {report.get('internal_errors') or 'none'}")
    for signature in new:
        print(f"    {found[signature].get('case_file')}  {signature[:200]}")
    untriaged = untriaged or bool(new) or bool(report.get("internal_errors"))
sys.exit(1 if untriaged else 0)
PY
echo "reports and cases: $out"
exit $status
