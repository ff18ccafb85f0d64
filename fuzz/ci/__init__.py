"""`kvfuzz ci`: guard a vLLM change in continuous integration.

One run, in order (fuzz/ci/run.py):
1. the gate: replay the built-in corpus and the CI corpus (`--corpus`, kept between runs) on the target;
2. a campaign of `--budget` seconds (fuzz.campaign.engine.Campaign), its new findings written to the CI corpus;
3. every failure of steps 1 and 2 run again in two fresh target processes (reproduce.py): one that does
   not fail the same way both times is flaky and never fails the job;
4. with `--baseline`, every failure also runs on the vLLM the change started from: one that fails
   there too is pre-existing;
5. exit 1 only for a reproducible failure the change introduced. The results go out as a Markdown
   summary (summary.py), SARIF 2.1.0 located at vLLM's source lines (sarif.py, locate.py) and JUnit XML (junit.py).
"""

from pathlib import Path

DEFAULT_BUDGET = 180.0  # seconds of fuzzing: a pull request's share of a 2-core runner
DEFAULT_CORPUS = Path(".kvfuzz-corpus")  # the CI corpus: CI keeps this folder between runs (a cache)
