"""The independent reference: expected KV-cache views derived from a Case and a contract.

Never imports vLLM. `expect(case, contract)` returns an Expectation: either the views every
layer must get, as strided byte layouts over the raw buffers, or the reason vLLM must reject
the case.
"""

from __future__ import annotations

from fuzz.case import Case
from oracles import backend_shaped, layout_placed
from oracles import contract as rules
from oracles.contract import CONTRACTS, LAYOUT_PLACED, LAYOUT_PLACED_KERNEL_MAP, Contract
from oracles.expectation import Expectation, LayerExpectation, PageRule, ViewExpectation


def buffer_bytes(case: Case, contract: Contract) -> int:
    """The bytes the case's raw buffers hold under the contract, without building its views."""
    if contract.layout_placed:
        return layout_placed.buffer_bytes(case)
    return backend_shaped.buffer_bytes(case, contract)


def runner_contract(contract: Contract, runner: str) -> Contract:
    """The contract the given model runner of a release follows ("v2": the release's own, "v1": the V1 runner's)."""
    return rules.v1_contract(contract) if runner == "v1" else contract


def expect(case: Case, contract: Contract, runner: str = "v2") -> Expectation:
    contract = runner_contract(contract, runner)
    if contract.layout_placed:
        return layout_placed.expect(case, contract)
    return backend_shaped.expect(case, contract, runner)


__all__ = [
    "CONTRACTS",
    "LAYOUT_PLACED",
    "LAYOUT_PLACED_KERNEL_MAP",
    "Contract",
    "Expectation",
    "LayerExpectation",
    "PageRule",
    "ViewExpectation",
    "buffer_bytes",
    "expect",
    "runner_contract",
]
