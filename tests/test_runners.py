"""Both model runners on one case: each judged against its own contract, then their layouts against each other."""

import dataclasses

from fuzz.case import Case, GroupCase, SpecCase, SyntheticBackend
from fuzz.targets.base import BufferRecord, Execution, Outcome, ViewRecord
from fuzz.verdict.runner import CaseResult, judge, other_runners
from fuzz.verdict.runners import compare_runners
from oracles import expect, runner_contract
from oracles.contract import LAYOUT_PLACED, SHAPED_019, SHAPED_020, SHAPED_021, SHAPED_022, SHAPED_027

FULL = SpecCase(kind="full", block_size=64, num_kv_heads=2, head_size=64)
KERNEL_16 = SyntheticBackend("k16", kernel_block_sizes=(16,), shape=("B", 2, "T", "H", "D"))
CASE = Case(groups=(GroupCase(spec=FULL, layers=("l0",), synthetic_backend=KERNEL_16, kernel_block_size=16),), num_blocks=3,
            layout="NHD", runner="both")


def as_built(case: Case, contract, runner: str, **changes) -> Outcome:
    """An outcome whose views are exactly the ones the runner's contract expects (changes: view fields to alter)."""
    expected = expect(case, contract, runner)
    views = {name: tuple(dataclasses.replace(ViewRecord(shape=v.shape, stride=tuple(s // v.element_size for s in v.byte_strides),
                                                        offset_bytes=v.byte_offset, dtype=v.dtype, element_size=v.element_size,
                                                        buffer=v.buffer), **changes.get(name, {}))
                         for v in layer.views) for name, layer in expected.layers.items()}
    buffers = tuple(BufferRecord(size=size, layers=tuple(n for n, layer in expected.layers.items() if layer.views[0].buffer == i))
                    for i, size in enumerate(expected.buffers))
    return Outcome(views=views, buffers=buffers, runner=runner)


def run_by_both(case: Case, v2: Outcome, v1: Outcome) -> Execution:
    """An execution of a case run by both runners: the V2 runner's views, the V1 runner's as its check's record."""
    return Execution(dataclasses.replace(case, runner="both"), outcome=dataclasses.replace(v2, checks={"v1-runner": v1.to_dict()}))


def v1_of(result: CaseResult, contract) -> CaseResult:  # noqa: ANN001
    [(label, v1)] = other_runners(result, contract)
    assert label.startswith("V1 model runner")
    return v1


def test_the_v1_runner_splits_kernel_blocks_where_the_v2_runner_did_not_yet():
    assert (runner_contract(SHAPED_019, "v1").kernel_split, runner_contract(SHAPED_019, "v1").shape_block) == (True, "slots")
    assert runner_contract(SHAPED_020, "v1").padded_pages and runner_contract(SHAPED_021, "v1") == SHAPED_022
    for same in (SHAPED_022, SHAPED_027, LAYOUT_PLACED):
        assert runner_contract(same, "v1") is same and runner_contract(same, "v2") is same
    # 64-token blocks, kernel 16: V2 of 0.19 views 3 blocks of 64 tokens, V1 12 kernel blocks of 16 (design notes §1.5).
    assert expect(CASE, SHAPED_019, "v2").layers["l0"].views[0].shape == (3, 2, 64, 2, 64)
    assert expect(CASE, SHAPED_019, "v1").layers["l0"].views[0].shape == (12, 2, 16, 2, 64)


def test_same_bytes_in_another_order_is_a_runner_mismatch():
    v2, v1 = as_built(CASE, SHAPED_019, "v2"), as_built(CASE, SHAPED_019, "v1")
    result = judge(run_by_both(CASE, v2, v1), SHAPED_019)
    assert v1_of(result, SHAPED_019).verdict.status == "pass" and result.verdict.status == "finding"
    finding = result.verdict.finding
    assert (finding.kind, finding.layer) == ("runner-mismatch", "l0")
    # One bug, whatever case shows it: the signature names kind, function and message; spec kind, backend and layout are the variant.
    assert finding.variant == ("full", "synthetic:k16", "NHD")
    assert finding.signature.startswith("runner-mismatch | GPUModelRunner.initialize_kv_cache_tensors | block # holds the same bytes")
    # Token 0's V of head 0 (content element 64: K's 64 elements come first): after the K of all 64 tokens under V2
    # (64 * 2 heads * 64 * 2 B = 16384), after the K of the kernel block's 16 tokens under V1 (16 * 256 = 4096).
    assert "element (state 0, head 0, content 64) is at byte 16384 under the V2 runner, 4096 under the V1 runner" in finding.message


def test_identical_layouts_agree_and_other_bytes_are_named():
    split = dataclasses.replace(CASE)
    same = judge(run_by_both(split, as_built(split, SHAPED_022, "v2"), as_built(split, SHAPED_022, "v1")), SHAPED_022)
    assert same.verdict.status == "pass"
    # A V1 layout whose blocks sit elsewhere fails its own oracle first: that runner's finding, not a mismatch.
    shifted = as_built(split, SHAPED_022, "v1", l0={"offset_bytes": 2})
    result = judge(run_by_both(split, as_built(split, SHAPED_022, "v2"), shifted), SHAPED_022)
    assert result.verdict.finding.kind != "runner-mismatch" and v1_of(result, SHAPED_022).verdict.status == "finding"


def test_one_runner_refusing_what_the_other_builds_is_a_runner_mismatch():
    refused = Outcome(error_type="ValueError", error_message="no", error_function="_reshape_kv_cache_tensors", runner="v1")
    k64 = SyntheticBackend("k64", (64,), None, ("B", 2, "T", "H", "D"))
    padded = dataclasses.replace(CASE, groups=(dataclasses.replace(CASE.groups[0], kernel_block_size=64, synthetic_backend=k64),))
    assert expect(padded, SHAPED_019, "v1").accepted
    ok = as_built(padded, SHAPED_019, "v2")
    # Both runners must accept it here, so the V1 refusal is the V1 runner's own refused-valid finding.
    assert judge(run_by_both(padded, ok, refused), SHAPED_019).verdict.finding.kind == "refused-valid"
    # Where the V1 contract rejects what the V2 contract builds (a padded page split into kernel blocks), a refusal is
    # V1's to make, and the disagreement of the runners is the finding.
    pad = dataclasses.replace(FULL, page_size_padded=40960)
    both = Case(groups=(GroupCase(spec=pad, layers=("l0",), synthetic_backend=KERNEL_16, kernel_block_size=16),), num_blocks=1, layout="NHD",
                runner="both")
    v2 = as_built(both, SHAPED_020, "v2")
    assert not expect(both, SHAPED_020, "v1").accepted
    verdict = compare_runners(both, (judge(Execution(both, outcome=v2), SHAPED_020).verdict, expect(both, SHAPED_020), v2),
                              (judge(Execution(both, outcome=dataclasses.replace(refused)), SHAPED_020).verdict, None, refused))
    assert verdict is not None and verdict.finding.kind == "runner-mismatch"
    assert verdict.finding.message.startswith("the V1 runner refuses what the V2 runner builds (ValueError: no)")


def test_the_v1_adapter_names_layers_as_binding_needs_and_maps_vllms_errors_back():
    from dataclasses import dataclass, field

    from fuzz.targets.runner_v1 import V1Runner, _renamed

    @dataclass
    class Group:
        layer_names: list[str] = field(default_factory=list)
        spec: str = "l0"  # a string that is a layer name only by accident still names that layer

    @dataclass(frozen=True)
    class Spec:
        shapes: tuple[tuple[int, ...], ...] = ((2, 3),)

    names = {"l0": "model.layers.0.kvfuzz", "l1": "model.layers.1.kvfuzz"}
    spec = Spec()
    original = [Group(["l0", "l1"]), {"l1": ("l0", {"x"})}, spec]
    renamed = _renamed(original, names)
    assert renamed[0].layer_names == ["model.layers.0.kvfuzz", "model.layers.1.kvfuzz"]
    assert renamed[1] == {"model.layers.1.kvfuzz": ("model.layers.0.kvfuzz", {"x"})}
    # The runner gets copies: what kvfuzz keeps (the walk the consumers run on) keeps its names; a frozen object that
    # holds no name is shared, not copied.
    assert original[0].layer_names == ["l0", "l1"] and original[1] == {"l1": ("l0", {"x"})}
    assert renamed[0] is not original[0] and renamed[2] is spec
    runner = object.__new__(V1Runner)
    runner.names = {renamed: name for name, renamed in names.items()}
    raised = Outcome(error_type="KeyError", error_message="KeyError: 'model.layers.1.kvfuzz' (after model.layers.0.kvfuzz)",
                     error_layer="model.layers.1.kvfuzz", runner="v1")
    back = runner.restore(raised)
    assert (back.error_message, back.error_layer) == ("KeyError: 'l1' (after l0)", "l1")
