"""SARIF 2.1.0 from `kvfuzz ci`, validated with jsonschema against the official schema (vendored in tests/data)."""

import json
from collections import Counter
from functools import cache
from pathlib import Path

import jsonschema

from fuzz.ci.model import CAMPAIGN, CORPUS, FLAKY, INTRODUCED, PRE_EXISTING, Checked, CiResult, Location
from fuzz.ci.sarif import RULES, sarif_log, write_sarif
from fuzz.corpus.builtin import builtin_corpus
from fuzz.corpus.store import entries
from fuzz.verdict.findings import KINDS, Finding

SCHEMA = Path(__file__).resolve().parent / "data" / "sarif-schema-2.1.0.json"


@cache
def validator() -> jsonschema.protocols.Validator:
    schema = json.loads(SCHEMA.read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def sarif_errors(log: dict) -> list[str]:
    return [f"{'/'.join(map(str, error.absolute_path))}: {error.message}" for error in validator().iter_errors(log)]


def item(status: str, kind: str, message: str, locations: list[Location], origin: str = CAMPAIGN) -> Checked:
    finding = Finding(kind, "mla", "create_kv_cache_views" if locations else "worker", message, "g0.l0")
    case = next(entries(builtin_corpus() / "seeds")).case
    reruns = [finding.signature, finding.signature if status != FLAKY else "pass"]
    return Checked(origin, Path(f".kvfuzz-corpus/findings/{finding.signature_id}.json"), case, finding, reruns,
                   "pass" if status == INTRODUCED else finding.signature, status != INTRODUCED, status, f"explain of {message}", locations)


def run_result() -> CiResult:
    raised = [Location("vllm/v1/kv_cache_interface.py", 428, None, "create_kv_cache_views")]
    under_test = [Location("vllm/v1/kv_cache_interface.py", 377, 441, "create_kv_cache_views"),
                  Location("vllm/v1/worker/utils.py", 460, 473, "map_kv_caches_to_kernel_blocks")]
    items = [
        item(INTRODUCED, "crash-on-valid", "RuntimeError: setStorage 12 out of bounds", raised),
        item(INTRODUCED, "crash-on-valid", "RuntimeError: setStorage 99 out of bounds", raised, CORPUS),  # same signature
        item(PRE_EXISTING, "page-escape", "a block's bytes leave its page", under_test),
        item(FLAKY, "hang", "no answer within 60 s", []),
    ]
    target = {"spec": ".", "label": "checkout", "vllm_version": "dev", "generation": "G6", "contract": "placed-0.32"}
    return CiResult(target, {"spec": "/tmp/base", "vllm_version": "dev"}, Path(".kvfuzz-corpus"), Counter({"pass": 8}), {}, items)


def test_log_is_valid_sarif_with_one_result_per_signature(tmp_path):
    path = tmp_path / "kvfuzz.sarif"
    write_sarif(path, run_result(), "0.2.0")
    log = json.loads(path.read_text())
    assert sarif_errors(log) == []
    run = log["runs"][0]
    results = run["results"]
    assert [(r["ruleId"], r["level"], r["baselineState"]) for r in results] == [
        ("crash-on-valid", "error", "new"), ("page-escape", "warning", "unchanged"), ("hang", "note", "new")]
    rules = run["tool"]["driver"]["rules"]
    assert all(rules[r["ruleIndex"]]["id"] == r["ruleId"] for r in results)
    assert "explain of RuntimeError: setStorage 12 out of bounds" in results[0]["message"]["text"]
    assert "kvfuzz replay .kvfuzz-corpus/findings/" in results[0]["message"]["text"]


def test_results_sit_at_the_raising_line_or_the_functions_under_test():
    results = sarif_log(run_result(), "0.2.0")["runs"][0]["results"]
    raised = results[0]["locations"][0]["physicalLocation"]
    assert raised == {"artifactLocation": {"uri": "vllm/v1/kv_cache_interface.py", "uriBaseId": "%SRCROOT%"}, "region": {"startLine": 428}}
    wrong_view = results[1]
    assert wrong_view["locations"][0]["physicalLocation"]["region"] == {"startLine": 377, "endLine": 441}
    assert wrong_view["relatedLocations"][0]["physicalLocation"]["artifactLocation"]["uri"] == "vllm/v1/worker/utils.py"
    assert "locations" not in results[2]  # a hang has no line; code scanning files it under the rule


def test_every_finding_kind_is_a_rule():
    assert set(RULES) == set(KINDS)
    rules = sarif_log(run_result(), "0.2.0")["runs"][0]["tool"]["driver"]["rules"]
    assert [rule["id"] for rule in rules] == list(KINDS)


def test_the_validator_rejects_what_the_schema_forbids():
    log = sarif_log(run_result(), "0.2.0")
    log["runs"][0]["results"][0]["level"] = "fatal"
    log["runs"][0]["results"][1]["locations"][0]["physicalLocation"]["region"]["startLine"] = 0
    del log["runs"][0]["tool"]["driver"]["name"]
    errors = sarif_errors(log)
    assert len(errors) == 3, errors
    assert any("fatal" in e for e in errors) and any("startLine" in e for e in errors) and any("'name' is a required" in e for e in errors)
