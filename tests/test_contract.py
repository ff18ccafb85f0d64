"""Every design choice of vLLM's the oracle uses is a rule in oracles/contract.py that names its source."""

from pathlib import Path

from oracles.contract import RULES

ORACLES = Path(__file__).resolve().parent.parent / "oracles"


def test_every_rule_states_itself_and_names_its_source():
    assert len(RULES) >= 15
    for rule in RULES.values():
        assert rule.statement, rule.name
        assert "vllm" in rule.source.lower() and ("'" in rule.source or "`" in rule.source), f"{rule.name}: quote the source"


def test_every_rule_is_applied_by_an_oracle():
    text = "".join(p.read_text() for p in ORACLES.glob("*.py") if p.name != "contract.py")
    unused = [name for name in RULES if f"rules.{name}(" not in text and f"contract.{name}(" not in text]
    assert not unused, unused
