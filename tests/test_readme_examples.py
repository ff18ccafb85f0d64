"""Every kvfuzz command line README.md and docs/reference/*.md show parses with kvfuzz's own parser, and (slow) runs as shown.

Commands come from the pages' code blocks and inline code; the usage block of docs/reference/cli.md ("## Synopsis") is
checked against the parser's options instead. Placeholders (FILE, SPEC, X.Y.Z, N|auto)
become real values. A command that runs to its end must exit 0 or 1 with no error or traceback; a campaign
is stopped a few seconds after its first progress line (its options, target and corpus all accepted).
Commands that need what this machine lacks, or take minutes, are skipped with the reason.
"""

import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fuzz.cli import _parser
from tests.test_entry_points import checkout_of_installed

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
REFERENCE = REPO / "docs" / "reference"
CLI_REFERENCE = REFERENCE / "cli.md"
SYNOPSIS = "## Synopsis"  # the heading above cli.md's usage block: one synopsis per subcommand
FINDING = str(sorted((REPO / "corpus" / "findings").glob("*.json"))[0].relative_to(REPO))
PLACEHOLDERS = {"FILE": FINDING, "CASE": FINDING, "SPEC": "installed", "X.Y.Z": "0.32.0", "N|auto": "2", "PATH": "corpus"}
# Commands not run here, and why (matched on the start of the command).
NOT_RUN = {
    "kvfuzz run --ray": "needs a Ray cluster (tests/test_ray.py runs one on this machine)",
    "kvfuzz ci --vllm .": "runs in a vLLM clone; tests/test_ci.py runs kvfuzz ci on such a tree",
    "kvfuzz ci --vllm installed --budget 120": "tests/test_ci.py runs this with a 20 s budget (the acceptance run)",
    "kvfuzz bisect": "replays the case on every release: minutes",
    "kvfuzz bench": "measures for minutes",
    "kvfuzz run --engine atheris": "tests/test_atheris.py runs atheris campaigns, and "
                                   "test_atheris_without_workers_passes_its_option_check this command's options",
}
OUTPUT_OPTIONS = ("--out", "--output")  # commands that differ only in where they write run once
CHECKOUT = "/path/to/vllm"
STARTUP_SECONDS = 40.0  # a campaign still running this long after it started has accepted its options and target
# A line that says the command is past its checks and running: a campaign's progress line, or mutate's tracing of the
# unmutated tree once its target is up. A campaign is stopped this long after it: its options, target and corpus were
# all accepted by then.
RUNNING = re.compile(r"kvfuzz: (\d+ cases, |target up in .* tracing the unmutated tree's cases|.*, atheris on \w+, seed )")
RUNNING_SECONDS = 1.0
CAMPAIGNS = ("run", "selftest", "ci", "mutate")  # commands that run until stopped; every other one runs to its end
HARD_TIMEOUT = 900.0  # seconds any other command may take: a hang, not a slow machine


def pages() -> list[Path]:
    """The pages that show kvfuzz commands: README.md and every page of docs/reference/."""
    return [README, *sorted(REFERENCE.glob("*.md"))]


def usage_block(text: str) -> tuple[int, int]:
    """Where cli.md's usage block lies in its text: from its opening fence to past its closing one."""
    start = text.index("```", text.index(SYNOPSIS))
    return start, text.index("```", start + 3) + 3


def examples_text(page: Path) -> str:
    """The page's text without the usage block: what is left shows commands to run."""
    text = page.read_text()
    if page == CLI_REFERENCE:
        start, end = usage_block(text)
        text = text[:start] + text[end:]
    return text


def shown_commands() -> dict[str, str]:
    """kvfuzz example commands, each with the first page that shows it (relative to the repository)."""
    commands: dict[str, str] = {}
    for page in pages():
        for command in page_commands(examples_text(page)):
            commands.setdefault(command, str(page.relative_to(REPO)))
    return commands


def page_commands(text: str) -> list[str]:
    """kvfuzz example commands in one page's text: lines of code blocks and inline code spans with arguments."""
    found = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S) + re.findall(r"(?m)^((?: {4}.*\n)+)", text):
        found += [line.strip() for line in block.splitlines() if line.strip().startswith("kvfuzz ")]
    found += [span for span in inline_spans(text) if len(span.split()) > 2 and "[--" not in span]
    commands = [" ".join(re.sub(r"\s+#.*$", "", command).split()) for command in found]
    return list(dict.fromkeys(commands))


def inline_spans(text: str) -> list[str]:
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    return [" ".join(span.split()) for span in re.findall(r"`(kvfuzz [^`]+)`", prose)]


def synopses() -> list[str]:
    """Usage lines: cli.md's usage block and inline synopses such as `kvfuzz ci --vllm SPEC|PATH [--budget S] ...` on every page."""
    text = CLI_REFERENCE.read_text()
    start, end = usage_block(text)
    block = text[start + 3:end - 3]
    lines, current = [], ""
    for line in block.splitlines():
        if line.startswith("kvfuzz "):
            lines.append(current)
            current = line
        else:
            current += " " + line.strip()
    inline = [span for page in pages() for span in inline_spans(examples_text(page)) if "[--" in span]
    return [line for line in lines + [current] if line.strip()] + inline


def argv_of(command: str) -> list[str]:
    """The arguments after `kvfuzz`, placeholders filled in and optional [ARGS] left out."""
    tokens = [token for token in shlex.split(command)[1:] if not re.fullmatch(r"\[[A-Z]+\]", token)]
    return [PLACEHOLDERS.get(token, token) for token in tokens]


def run_once(commands: list[str]) -> list[str]:
    """The commands, one of each that differ only in the value of an output option (the first shown)."""
    def key(command: str) -> tuple[str, ...]:
        tokens = command.split()
        return tuple("OUT" if i and tokens[i - 1] in OUTPUT_OPTIONS else t for i, t in enumerate(tokens))
    return list({key(command): command for command in reversed(commands)}.values())[::-1]


def first_of_each_subcommand(commands: list[str]) -> list:
    """The commands as pytest parameters: the first runnable one of each subcommand in the default suite, the others
    marked `sweep` (tests/sweep.py)."""
    seen: set[str] = set()
    params = []
    for command in commands:
        subcommand = command.split()[1]
        if runnable(command) is None and subcommand not in seen:
            seen.add(subcommand)
            params.append(command)
        else:
            params.append(pytest.param(command, marks=pytest.mark.sweep))
    return params


SHOWN = shown_commands()
COMMANDS = list(SHOWN)
RUN = run_once(COMMANDS)


def test_readme_shows_the_commands_it_should():
    assert {page.name for page in pages()} >= {"README.md", "cli.md", "ci.md", "campaigns.md", "export.md", "verdicts.md"}
    assert CLI_REFERENCE.read_text().count(SYNOPSIS) == 1
    subcommands = {command.split()[1] for command in COMMANDS}
    assert {"run", "replay", "explain", "ci", "selftest"} <= subcommands, COMMANDS
    assert "kvfuzz run --engine atheris" in COMMANDS and "kvfuzz replay --builtin-corpus" in COMMANDS
    # The guide itself shows how to run, read, replay, guard a branch and hand a finding on, not only the reference pages.
    guide = {command.split()[1] for command in page_commands(README.read_text())}
    assert {"run", "replay", "explain", "bisect", "ci", "export", "report"} <= guide, guide


@pytest.mark.parametrize("command", COMMANDS)
def test_readme_command_parses(command):
    try:
        _parser().parse_args(argv_of(command))
    except SystemExit as exit_:
        pytest.fail(f"{SHOWN[command]}'s `{command}` does not parse (exit {exit_.code})")


def test_usage_lines_name_only_options_that_exist():
    parsers = _parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    lines = synopses()
    for line in lines:
        command = line.split()[1]
        assert command in parsers, f"the docs name a subcommand kvfuzz lacks: {line}"
        unknown = set(re.findall(r"(--[a-z][a-z-]*)", line)) - set(parsers[command]._option_string_actions)
        assert not unknown, f"`{line}` names options kvfuzz {command} lacks: {sorted(unknown)}"
    assert set(parsers) <= {line.split()[1] for line in lines}, "a subcommand is missing from docs/reference/cli.md's synopsis"


def test_atheris_without_workers_passes_its_option_check(monkeypatch):
    """The docs' `kvfuzz run --engine atheris` (no --workers) reaches the engine; --workers 2 is refused before it."""
    from fuzz.commands import _run_atheris
    from fuzz.engines import atheris_engine
    from fuzz.errors import UsageError

    started = []
    monkeypatch.setattr(atheris_engine, "run_atheris", lambda *args, **kwargs: started.append(kwargs) or {"findings": []})
    with pytest.raises(UsageError, match="runs one process"):
        _run_atheris(_parser().parse_args(["run", "--engine", "atheris", "--workers", "2"]), sys.stdout)
    assert started == []
    assert _run_atheris(_parser().parse_args(argv_of("kvfuzz run --engine atheris")), sys.stdout) == 0
    assert len(started) == 1 and started[0]["max_time"] == 60.0


def runnable(command: str) -> str | None:
    """Why the command is not run here, or None."""
    for start, reason in NOT_RUN.items():
        if command.startswith(start):
            return reason
    if "cuda" in command.split():
        import torch

        if not torch.cuda.is_available():
            return "needs a CUDA device"
    return None


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """A maintainer's clone: the installed vLLM laid out as one. One for every command that names it, so the second
    command finds the first one's bytecode and target standby, as a maintainer's second run does."""
    return checkout_of_installed(tmp_path_factory.mktemp("clone") / "vllm")


def test_commands_that_differ_only_in_their_output_run_once():
    shown = ["kvfuzz export corpus --out tests/kvfuzz", "kvfuzz export corpus --out DIR", "kvfuzz export FILE --out DIR",
             "kvfuzz report FILE --output issue.md"]
    assert run_once(shown) == ["kvfuzz export corpus --out tests/kvfuzz", "kvfuzz export FILE --out DIR",
                               "kvfuzz report FILE --output issue.md"]
    assert {" ".join(c.split()[:3]) for c in RUN} == {" ".join(c.split()[:3]) for c in COMMANDS}


@pytest.mark.slow
@pytest.mark.parametrize("command", first_of_each_subcommand(RUN))
def test_readme_command_runs(command, tmp_path, request):
    reason = runnable(command)
    if reason:
        pytest.skip(reason)
    (tmp_path / "corpus").symlink_to(REPO / "corpus")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))}
    argv = argv_of(command)
    if CHECKOUT in argv:
        argv[argv.index(CHECKOUT)] = str(request.getfixturevalue("checkout"))
    if argv[0] == "run" and "--corpus" not in argv:
        argv += ["--corpus", str(tmp_path / "findings")]  # the docs' runs write to corpus/findings: not the repository's
    process = subprocess.Popen([sys.executable, "-m", "fuzz.cli", *argv], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(process.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    campaign = argv[0] in CAMPAIGNS
    deadline, running_since = time.monotonic() + (STARTUP_SECONDS + 60 if campaign else HARD_TIMEOUT), None
    while process.poll() is None and time.monotonic() < deadline:
        if running_since is None and any(RUNNING.match(line) for line in list(lines)):
            running_since = time.monotonic()
        if running_since is not None and time.monotonic() - running_since > RUNNING_SECONDS:
            break
        time.sleep(0.2)
    stopped = process.poll() is None
    if stopped:
        os.killpg(process.pid, signal.SIGINT)
    process.wait(timeout=120)
    reader.join(timeout=30)
    output = "".join(lines)
    assert not any(marker in output for marker in ("kvfuzz: error:", "usage: kvfuzz", "Traceback (most recent call last)")), output[-2000:]
    if not stopped:
        assert process.returncode in (0, 1), output[-2000:]
    else:
        assert campaign, f"only campaigns may outlast the limit: {output[-2000:]}"
