"""Per-layer head sizes (issue 46): layers of one type whose heads differ in size (an MLA layer's latent too) make one
UniformTypeKVCacheSpecs group of several page sizes, as layers that differ in KV heads or precision do.

Pages are worked out by hand from what a page holds: 16 tokens x 1 head x K and V x the head size x 2 bytes (bf16) for
attention, 16 tokens x the latent x 2 bytes for MLA; the target tests run the installed vLLM and skip before 0.29."""

from __future__ import annotations

import dataclasses
import json

import pytest

from fuzz.case import Case, CaseError, GroupCase, SpecCase, from_dict, to_dict, validate
from fuzz.corpus import minimize
from fuzz.verdict.runner import run_case
from oracles import expect, pages
from oracles.contract import LAYOUT_PLACED_KERNEL_MAP
from tests.conftest import synthetic_info

FULL = SpecCase(kind="full", block_size=16, num_kv_heads=1, head_size=64, dtype="bfloat16")
MLA = SpecCase(kind="mla", block_size=16, num_kv_heads=1, head_size=576, dtype="bfloat16")


def sized(sizes: tuple[int, ...] = (64, 128), spec: SpecCase = FULL, layout: str = "LBNHC", backend: str = "TRITON_ATTN") -> Case:
    group = GroupCase(spec=spec, layers=tuple(f"l{i}" for i in range(len(sizes))), backend=backend, kernel_block_size=16,
                      layer_head_sizes=sizes)
    return Case(groups=(group,), num_blocks=3, layout=layout, packing="uniform_type")


def test_each_layer_takes_its_own_head_size():
    group = sized((64, 128, 64)).groups[0]
    assert [spec.head_size for spec in group.layer_specs] == [64, 128, 64]
    assert [pages.page(spec).page_bytes for spec in group.layer_specs] == [16 * 2 * 64 * 2, 16 * 2 * 128 * 2, 16 * 2 * 64 * 2]
    mla = sized((576, 512), MLA, backend="CPU_MLA").groups[0]
    assert [pages.page(spec).page_bytes for spec in mla.layer_specs] == [16 * 576 * 2, 16 * 512 * 2]
    assert group.of_layer(1) == dataclasses.replace(group, spec=group.layer_spec(1), layer_head_sizes=())
    assert group.differs_per_layer and not dataclasses.replace(group, layer_head_sizes=()).differs_per_layer


def test_the_oracle_places_layers_of_two_head_sizes_by_hand():
    # Block-outermost: l0's 4096-byte page, then l1's 8192, inside every 12288-byte block row.
    block_outer = expect(sized(layout="BLNHC"), LAYOUT_PLACED_KERNEL_MAP)
    assert {n: v.views[0].byte_offset for n, v in block_outer.layers.items()} == {"l0": 0, "l1": 4096}
    assert {n: v.views[0].byte_strides[0] for n, v in block_outer.layers.items()} == {"l0": 12288, "l1": 12288}
    assert block_outer.buffers == (3 * 12288,)
    # Layer-outer: l0's three blocks (12288 bytes), then l1's (24576).
    layer_outer = expect(sized(layout="LBNHC"), LAYOUT_PLACED_KERNEL_MAP)
    assert {n: v.views[0].byte_offset for n, v in layer_outer.layers.items()} == {"l0": 0, "l1": 12288}
    assert layer_outer.buffers == (12288 + 24576,)


def test_case_json_round_trip_and_errors():
    case = sized()
    data = to_dict(case)
    assert data["groups"][0]["layer_head_sizes"] == [64, 128]
    assert from_dict(json.loads(json.dumps(data))) == case
    plain = to_dict(dataclasses.replace(case, groups=(dataclasses.replace(case.groups[0], layer_head_sizes=()),)))
    assert "layer_head_sizes" not in plain["groups"][0]  # older cases keep their JSON and hashes
    group = case.groups[0]
    for bad, message in ((dataclasses.replace(group, layer_head_sizes=(64,)), "one head size per layer"),
                         (dataclasses.replace(group, layer_head_sizes=(64, 0)), "must be positive"),
                         (dataclasses.replace(group, spec=dataclasses.replace(FULL, head_size_v=32)), "holds one head size")):
        with pytest.raises(CaseError, match=message):
            validate(dataclasses.replace(case, groups=(bad,)))
    with pytest.raises(CaseError, match="packing uniform_type"):
        validate(dataclasses.replace(case, packing="none"))


def test_minimizer_drops_a_layer_with_its_head_size_and_the_dimension():
    case = sized((64, 128, 32))
    info = synthetic_info()
    for candidate in minimize._drop_layers(case, info):
        validate(candidate)
        group = candidate.groups[0]
        assert group.layer_head_sizes == tuple(case.groups[0].layer_head_sizes[int(name[1:])] for name in group.layers)
    assert any(not c.groups[0].layer_head_sizes for c in minimize._simpler_options(case, info))


@pytest.mark.parametrize(("spec", "sizes", "backend"), [(FULL, (64, 128), "TRITON_ATTN"), (MLA, (576, 512), "TRITON_MLA")],
                         ids=["attention", "mla"])
def test_layers_of_two_head_sizes_on_vllm(kvfuzz_target, kvfuzz_device, spec, sizes, backend):
    if not kvfuzz_target.info.contract.layout_placed:
        pytest.skip("layers that differ in size are drawn from vLLM 0.29")
    if backend not in {b.name for b in kvfuzz_target.info.backends}:
        pytest.skip(f"no {backend} here")
    for layout in ("LBNHC", "BLNHC"):
        case = sized(sizes, spec, layout, backend)
        result = run_case(kvfuzz_target, case, kvfuzz_device)
        assert result.verdict.status == "pass", (layout, result.verdict)
        offsets = {name: views[0].offset_bytes for name, views in result.outcome.views.items()}
        assert offsets == {n: v.views[0].byte_offset for n, v in result.expectation.layers.items()}
        shapes = {name: tuple(views[0].shape) for name, views in result.outcome.views.items()}
        assert shapes == {n: tuple(v.views[0].shape) for n, v in result.expectation.layers.items()}
        assert shapes["l0"] != shapes["l1"]
