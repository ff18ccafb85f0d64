"""examples/github/kvfuzz.yml: valid against GitHub's workflow schema (check-jsonschema's vendored copy),
and wired as docs/reference/ci.md says: pull requests on the KV-cache code, a nightly campaign, the CI corpus
cached, SARIF to code scanning, kvfuzz command lines kvfuzz itself accepts."""

import importlib.util
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fuzz.cli import _parser

WORKFLOW = Path(__file__).resolve().parents[1] / "examples" / "github" / "kvfuzz.yml"
RUNNER = {"$GITHUB_RUN_NUMBER": "42"}  # what GitHub's runner puts in the variables the commands read as numbers


@pytest.fixture(scope="module")
def workflow() -> dict:
    data = yaml.safe_load(WORKFLOW.read_text())
    data["on"] = data.pop(True, data.get("on"))  # YAML 1.1 reads the key `on` as true
    return data


def steps(workflow: dict) -> list[dict]:
    return workflow["jobs"]["kvfuzz"]["steps"]


def kvfuzz_commands(workflow: dict) -> dict[str, list[str]]:
    """The `kvfuzz ci` step of each event kind: its arguments after `kvfuzz`."""
    found = {}
    for step in steps(workflow):
        run = " ".join(step.get("run", "").split())
        if run.startswith("kvfuzz "):
            found[step["if"]] = [RUNNER.get(token, token) for token in shlex.split(run)[1:]]
    return found


@pytest.mark.skipif(importlib.util.find_spec("check_jsonschema") is None, reason="pip install check-jsonschema (kvfuzz[dev])")
def test_workflow_is_valid_for_github():
    result = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.github-workflows", str(WORKFLOW)],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_pull_requests_on_the_kv_cache_code_and_a_nightly_schedule(workflow):
    paths = workflow["on"]["pull_request"]["paths"]
    assert "vllm/v1/kv_cache_interface.py" in paths and "vllm/v1/worker/gpu/attn_utils.py" in paths
    vllm = importlib.util.find_spec("vllm")
    if vllm is not None:  # every filter names code the installed vLLM has
        root = Path(vllm.submodule_search_locations[0]).parent
        missing = [path for path in paths if path.startswith("vllm/") and not list(root.glob(path))]
        assert missing == [], missing
    assert workflow["on"]["schedule"][0]["cron"].split()[:2] == ["17", "3"]
    assert workflow["permissions"]["security-events"] == "write"


def test_kvfuzz_runs_on_the_branch_against_the_merge_base(workflow):
    commands = kvfuzz_commands(workflow)
    pull_request = commands["github.event_name == 'pull_request'"]
    nightly = commands["github.event_name != 'pull_request'"]
    parser = _parser()
    for argv in (pull_request, nightly):
        args = parser.parse_args(argv)
        assert (args.command, args.vllm, str(args.corpus)) == ("ci", ".", ".kvfuzz-corpus")
    assert parser.parse_args(pull_request).baseline == "$RUNNER_TEMP/baseline"
    assert parser.parse_args(nightly).baseline is None and parser.parse_args(nightly).budget == 3600
    worktree = next(step["run"] for step in steps(workflow) if "git worktree add" in step.get("run", ""))
    assert '"$RUNNER_TEMP/baseline"' in worktree and "git merge-base" in worktree
    checkout = next(step for step in steps(workflow) if step.get("uses", "").startswith("actions/checkout@"))
    assert checkout["with"]["fetch-depth"] == 0  # the merge base needs the history


def test_corpus_is_cached_and_results_uploaded(workflow):
    argv = kvfuzz_commands(workflow)["github.event_name == 'pull_request'"]
    args = _parser().parse_args(argv)
    uses = {step.get("uses", "").split("@")[0]: step for step in steps(workflow)}
    restore, save = uses["actions/cache/restore"], uses["actions/cache/save"]
    assert restore["with"]["path"] == save["with"]["path"] == str(args.corpus)
    assert save["if"] == "always()" and restore["with"]["restore-keys"]
    assert uses["github/codeql-action/upload-sarif"]["with"]["sarif_file"] == str(args.sarif)
    artifact = uses["actions/upload-artifact"]["with"]
    assert {str(args.junit), str(args.sarif), f"{args.corpus}/"} <= set(artifact["path"].split())
    assert artifact["include-hidden-files"] is True  # .kvfuzz-corpus is hidden
    install = next(step for step in steps(workflow) if "pip install" in step.get("run", ""))
    assert '"$KVFUZZ_INSTALL"' in install["run"] and workflow["env"]["PIP_EXTRA_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert workflow["env"]["KVFUZZ_INSTALL"].startswith("kvfuzz[cpu]")
