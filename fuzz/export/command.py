"""`kvfuzz export` and `kvfuzz report`: the commands' functions (their options are declared in fuzz/cli.py)."""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TextIO

from fuzz.errors import KvfuzzError
from fuzz.export import declared
from fuzz.export.code import NoTemplate
from fuzz.export.finding import FindingFile, finding_files, read_finding
from fuzz.export.reach import reach_of
from fuzz.export.report import Evidence, draft
from fuzz.export.templates import Exported, export_all

CORPUS_WORD = "corpus"  # `kvfuzz export corpus`: every finding of the corpus shipped with kvfuzz
BackendLayouts = Mapping[str, "tuple[str, ...] | None"]


def _findings(names: list[str]) -> list[FindingFile]:
    paths: list[Path] = []
    for name in names:
        if name == CORPUS_WORD:  # the word, whatever folder of that name lies here (its seeds are no findings)
            from fuzz.corpus.builtin import builtin_corpus

            paths.append(builtin_corpus() / "findings")
        else:
            paths.append(Path(name))
    return [read_finding(path) for path in finding_files(paths)]


def _backend_layouts(spec: str | None) -> tuple[BackendLayouts | None, str | None]:
    """Each shipped backend's declared layouts as the release `spec` reports them (None, None without a release)."""
    if spec is None:
        return None, None
    from fuzz.campaign.pool import Pool
    from fuzz.targets import releases

    with Pool(releases.resolve(spec), workers=1) as pool:
        assert pool.info is not None
        return {b.name: b.layouts for b in pool.info.backends}, pool.info.vllm_version


def export_command(args: argparse.Namespace, out: TextIO) -> int:
    """Writes one test module per finding that has a template; one line for each that has none. Exit 0 when any was
    written, 1 when none was."""
    findings = declared.ask(_findings(args.findings))
    layouts, version = _backend_layouts(args.vllm)
    args.out.mkdir(parents=True, exist_ok=True)
    written = 0
    for finding in findings:
        try:
            modules = export_all(finding, reach_of(finding.case, finding.meta, layouts))
        except NoTemplate as why:
            print(f"kvfuzz: {finding.path}: not exported: {why}", file=out)
            continue
        for exported in modules:
            (args.out / exported.file_name).write_text(exported.source)
        written += 1
        print(f"kvfuzz: {finding.path}: wrote {', '.join(str(args.out / m.file_name) for m in modules)}", file=out)
    where = f" (backend layouts from vLLM {version})" if version else ""
    print(f"kvfuzz: exported {written} of {len(findings)} finding(s) to {args.out}{where}", file=out)
    return 0 if written else 1


def report_command(args: argparse.Namespace, out: TextIO) -> int:
    [finding] = declared.ask([read_finding(args.finding)])
    spec = args.vllm or finding.newest_affected or "installed"
    layouts, evidence = _run_on(finding, spec, args)
    reach = reach_of(finding.case, finding.meta, layouts)
    try:
        # The module of the newest walk: the one a maintainer of today's vLLM drops into its tests.
        exported: Exported | None = export_all(finding, reach)[-1]
    except NoTemplate:
        exported = None
    if exported is not None and not args.no_test:
        evidence = _with_test_run(evidence, exported, spec)
    title = exported.title if exported is not None else f"{finding.kind} in {finding.function}: {finding.message}"
    text = draft(finding, reach, exported, title, evidence)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text)
        print(f"kvfuzz: wrote {args.output}", file=out)
    else:
        print(text, file=out, end="")
    return 0


def _run_on(finding: FindingFile, spec: str, args: argparse.Namespace) -> tuple[BackendLayouts, Evidence]:
    """The release's backend layouts and `kvfuzz explain`'s text for the case on it."""
    from fuzz.campaign.pool import Pool, RemoteTarget
    from fuzz.explain.render import render
    from fuzz.targets import releases
    from fuzz.verdict.runner import run_case

    with Pool(releases.resolve(spec), workers=1, case_timeout=args.case_timeout) as pool:
        target = RemoteTarget(pool)
        result = run_case(target, finding.case, "cpu")
        text = render(result, target)
        layouts = {b.name: b.layouts for b in target.info.backends}
        return layouts, Evidence(target.info.vllm_version, text)


def _with_test_run(evidence: Evidence, exported: Exported, spec: str) -> Evidence:
    """The exported test run on the release without kvfuzz: its outcome and pytest's `E` lines."""
    import dataclasses

    from fuzz.export.isolated import run_isolated
    from fuzz.targets import releases

    source = releases.resolve(spec)
    try:
        with tempfile.TemporaryDirectory(prefix="kvfuzz-report-") as folder:
            module = Path(folder) / exported.file_name
            module.write_text(exported.source)
            run = run_isolated(module, source.python_path)
    except (OSError, KvfuzzError):
        return evidence
    errors: list[str] = []
    for line in (line[1:].strip() for line in run.output.splitlines() if line.startswith("E ")):
        if line.startswith("assert ") or len(errors) == 4:  # pytest's own rewriting of the assertion follows
            break
        errors.append(line)
    errors = errors or ["(no assertion message)"]
    return dataclasses.replace(evidence, test_outcome=run.outcome, test_errors=tuple(errors))
