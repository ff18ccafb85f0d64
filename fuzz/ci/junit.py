"""JUnit XML of a `kvfuzz ci` run: the gate and the campaign as test cases, then one per bug (finding
signature) with the cases that showed it: a failure when it fails the job, skipped with the reason when
pre-existing or flaky. kvfuzz's own internal errors are one test case with an error, not a failure."""

from __future__ import annotations

from pathlib import Path

from fuzz.ci.model import Bug, CiResult
from fuzz.ci.present import differing_rows, origins_text, variants_text
from fuzz.junit import JUnitCase, Part, write_junit


def write_ci_junit(path: Path, result: CiResult) -> None:
    write_junit(path, "kvfuzz-ci", ci_cases(result), str(result.campaign.get("elapsed_s", 0)))


def ci_cases(result: CiResult) -> list[JUnitCase]:
    campaign, errors = result.campaign, result.internal_errors
    label = f"{result.target['label']} vLLM {result.target['vllm_version']}"
    gate = Part("system-out", ", ".join(f"{n} {status}" for status, n in sorted(result.gate.items())))
    fuzzed = Part("system-out", f"{campaign.get('cases', 0)} cases, {campaign.get('cases_per_s', 0)} cases/s, "
                                f"stopped by {campaign.get('stop_reason', '-')}")
    cases = [JUnitCase("kvfuzz.ci.gate", f"corpus replay on {label}", (gate,)),
             JUnitCase("kvfuzz.ci.campaign", f"campaign on {label}", (fuzzed,), str(campaign.get("elapsed_s", 0)))]
    if errors:
        text = "\n\n".join(f"{e.message} ({e.count}x; case {e.case_file or '-'})\n{e.traceback or ''}".rstrip() for e in errors)
        error = Part("error", text, "kvfuzz internal error: the job failed because of kvfuzz, not the change", "kvfuzz-internal-error")
        cases.append(JUnitCase("kvfuzz.ci.internal", "kvfuzz's own code", (error,)))
    return cases + [_bug_case(bug, result) for bug in result.bugs]


def _bug_case(bug: Bug, result: CiResult) -> JUnitCase:
    text = _text(bug, result)
    message = f"{bug.status}: {bug.example.finding.message} ({len(bug.items)} case(s))"
    parts = (Part("failure", text, message, bug.kind),) if bug.fails_job else (Part("skipped", message=message), Part("system-out", text))
    return JUnitCase(f"kvfuzz.ci.{bug.kind}", bug.signature, parts)


def _text(bug: Bug, result: CiResult) -> str:
    item = bug.example
    cases = "\n".join(f"  {case.status} ({case.origin}): {case.path}" for case in bug.items)
    return (f"{len(bug.items)} case(s) ({origins_text(bug.origins)}) under {variants_text(bug.variants)}\n"
            f"reproduce: {result.reproducer(item)}\nreruns: {item.reruns}\non the baseline: {item.baseline}\ncases:\n{cases}\n\n"
            f"{differing_rows(item.explain)}")
