"""The rule every exported view test quotes for its finding's kind, and how its body checks it (the views match the
oracle's, or vLLM refuses the configuration with the errors it promises)."""

from __future__ import annotations

import ast
import textwrap

from fuzz.export.code import BYTE_HELPERS, Module, indent
from fuzz.export.expected import INVALID_KINDS, VIEW_HELPERS, contracts, expectation, expected_literal
from fuzz.export.finding import FindingFile
from fuzz.export.runner_steps import quoted

REFUSAL_RULE = ("The rule (kvfuzz contract: vLLM refuses what its layouts cannot hold): {reason}. vLLM must refuse such a "
                "configuration with a ValueError or NotImplementedError naming what it does not support; an AssertionError is "
                "no refusal (it vanishes under python -O), and any other error means nothing checked the configuration.")
VIEWS_RULE = ("The rule (kvfuzz contract): vLLM runs this model, so each layer must get a view of the shape and dtype its layout "
              "declares, block b of a layer owns exactly the bytes listed for it in EXPECTED (inside its own page, none of "
              "another block's), and the elements inside a block lie in the declared order.")


def comment(text: str) -> str:
    return textwrap.fill(text, 110, initial_indent="# ", subsequent_indent="# ", break_long_words=False)


def reject_reason(finding: FindingFile) -> str:
    """Why the oracle rejects the case (the finding's message where the stored case alone does not tell)."""
    reasons = [expectation(finding, name).reject_reason for name in contracts(finding)] if finding.kind in INVALID_KINDS else []
    reason = next((reason for reason in reasons if reason), None)
    prefix = "accepted a case the contract rejects: "
    if reason is None and finding.message.startswith(prefix):
        reason = finding.message[len(prefix):]
    return reason or (f"kvfuzz's oracle rejects this case once its backend declares the cache shape (vLLM "
                      f"{finding.meta.get('vllm_version')} fails on it instead: {finding.message})")


def what(finding: FindingFile) -> str:
    """The module's one-line promise."""
    if finding.kind in INVALID_KINDS:
        return "vLLM must refuse this configuration with a ValueError or NotImplementedError."
    return "every layer's view must own exactly the bytes its layout gives each block."


def title(finding: FindingFile, where: str) -> str:
    titles = {"crash-on-invalid": f"{where} crashes on a configuration it should refuse", "assert-on-invalid":
              f"{where} refuses a configuration with an AssertionError, not a ValueError", "accepted-invalid":
              f"{where} accepts a configuration its layout cannot hold", "crash-on-valid": f"{where} crashes on a model vLLM runs",
              "refused-valid": f"{where} refuses a model vLLM runs"}
    return titles.get(finding.kind, f"{where} gives a layer a view that is not its blocks' bytes ({finding.kind})")


def hoisted_backends(body: str) -> tuple[str, str]:
    """`body` split into its backend lookups (`backend_N = backend_class(...)`) and the rest: a refusal test looks the
    backends up before `pytest.raises`, so that only vLLM's KV-cache code can raise what the test expects (a backend
    whose import fails half-way may raise anything, or skip)."""
    lines = body.splitlines(keepends=True)
    lookups: set[int] = set()
    for statement in ast.parse(textwrap.dedent(body)).body:
        value = getattr(statement, "value", None)
        if isinstance(statement, ast.Assign) and (
                isinstance(value, ast.Call) and getattr(value.func, "id", None) == "backend_class"
                or isinstance(value, ast.Name) and value.id == "AttentionBackend"):
            lookups.update(range(statement.lineno - 1, statement.end_lineno or statement.lineno))
    return ("".join(line for i, line in enumerate(lines) if i in lookups),
            "".join(line for i, line in enumerate(lines) if i not in lookups))


def add_contract_gate(module: Module, finding: FindingFile, probe: str) -> str:
    """CONTRACTS and the release probe (`probe`, a module-level `release_contract()`) added to `module`; returns the lines
    a test function starts with to skip on a release whose contract is not one the finding's rule and EXPECTED are
    written for."""
    names = contracts(finding)
    module.add("# The kvfuzz contracts the rule below holds under (that of each release the finding affects, and the next\n"
               "# one where kvfuzz's oracle judges the case alike); a release that follows another contract skips.\n"
               f"CONTRACTS = ({', '.join(map(quoted, names))}{',' if len(names) == 1 else ''})\n\n\n"
               + textwrap.dedent(probe).strip("\n"))
    return ("    if release_contract() not in CONTRACTS:\n"
            "        pytest.skip(f\"this vLLM follows kvfuzz's contract {release_contract()}, not one of {CONTRACTS}\")\n")


def add_check(module: Module, finding: FindingFile, name: str, body: str, probe: str) -> None:
    """The test function: `body` (the walk, indented) under the finding kind's rule and check, on releases whose
    contract is one the rule and EXPECTED are written for (add_contract_gate)."""
    gate = add_contract_gate(module, finding, probe)
    if finding.kind in INVALID_KINDS:
        rule = comment(REFUSAL_RULE.format(reason=reject_reason(finding).rstrip(".")))
        backends, rest = hoisted_backends(body)
        module.add(f"def {name}(vllm_config, monkeypatch):\n{gate}{backends}{indent(rule)}\n"
                   "    with pytest.raises((ValueError, NotImplementedError)):\n" + indent(rest))
        return
    module.add(expected_literal(finding))
    module.add(BYTE_HELPERS)
    module.add(VIEW_HELPERS)
    module.add(f"def {name}(vllm_config, monkeypatch):\n{gate}{body}\n\n{indent(comment(VIEWS_RULE))}\n"
               "    check_views(kv_caches, EXPECTED[release_contract()])")
