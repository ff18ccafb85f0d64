import dataclasses
import json

import pytest

from fuzz.case import Case, CaseError, GroupCase, SpecCase, dumps, loads, replace


def full_case() -> Case:
    spec = SpecCase(kind="full", block_size=16, num_kv_heads=2, head_size=64)
    return Case(groups=(GroupCase(spec=spec, layers=("l0",), backend="TRITON_ATTN", kernel_block_size=16),), num_blocks=4)


def test_round_trip_is_exact():
    case = full_case()
    assert loads(dumps(case)) == case


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda d: d.update(num_blocks=0), "num_blocks"),
        (lambda d: d.update(layout="XYZ"), "layout"),
        (lambda d: d["groups"][0]["spec"].update(dtype="float64"), "groups[0].spec.dtype"),
        (lambda d: d["groups"][0]["spec"].update(colour="red"), "groups[0].spec.colour"),
        (lambda d: d["groups"][0]["spec"].update(compress_ratio=3), "groups[0].spec.compress_ratio"),
        (lambda d: d["groups"][0].pop("backend"), "groups[0].backend"),
        (lambda d: d.update(kv_sharing={"x": "nowhere"}), "kv_sharing"),
        (lambda d: d.update(schema=99), "schema"),
    ],
)
def test_malformed_case_names_the_field(edit, field):
    data = json.loads(dumps(full_case()))
    edit(data)
    with pytest.raises(CaseError) as error:
        loads(json.dumps(data))
    assert str(error.value).startswith(field)
    assert "\n" not in str(error.value)


def test_invalid_json_is_one_line():
    with pytest.raises(CaseError, match="not valid JSON"):
        loads("{oops")


def test_a_layout_is_named_as_each_release_names_it():
    from fuzz.case import KV_CACHE_LAYOUTS, LEGACY_LAYOUTS, layout_as

    assert layout_as("LBNHC", LEGACY_LAYOUTS) == "NHD" and layout_as("LBHNC", LEGACY_LAYOUTS) == "HND"
    assert layout_as("NHD", KV_CACHE_LAYOUTS) == "LBNHC" and layout_as("HND", KV_CACHE_LAYOUTS) == "LBHNC"
    assert layout_as("BLNHC", KV_CACHE_LAYOUTS) == "BLNHC"
    assert layout_as("BLNHC", LEGACY_LAYOUTS) is None  # no legacy name: the release cannot express it


def test_runner_spec_source_and_packing_round_trip_and_stay_out_of_old_files():
    old = full_case()
    assert "runner" not in dumps(old) and "packing" not in dumps(old) and "spec_source" not in dumps(old)
    assert (old.runner, old.spec_source, old.packing) == ("v2", "case", "none")
    new = Case(groups=old.groups, num_blocks=4, runner="both", spec_source="vllm", packing="cross_layers")
    assert loads(dumps(new)) == new and json.loads(dumps(new))["runner"] == "both"
    assert new.describe().endswith("/both/vllm/cross_layers")
    for field, value in (("runner", "v3"), ("spec_source", "model"), ("packing", "dense")):
        data = json.loads(dumps(old))
        data[field] = value
        with pytest.raises(CaseError) as error:
            loads(json.dumps(data))
        assert str(error.value).startswith(field)


def test_replace_copies_like_dataclasses_replace() -> None:
    spec = SpecCase(kind="full", block_size=16, num_kv_heads=2, head_size=64)
    group = GroupCase(spec=spec, layers=("l0",), backend="TRITON_ATTN")
    case = Case(groups=(group,), num_blocks=4)
    changed = replace(case, num_blocks=7, layout="LBHNC")
    expected = dataclasses.replace(case, num_blocks=7, layout="LBHNC")
    assert changed == expected and hash(changed) == hash(expected)
    assert case.num_blocks == 4 and changed.groups is case.groups
    assert replace(spec, head_size=128) == dataclasses.replace(spec, head_size=128)
    with pytest.raises(TypeError, match="no field 'heads'"):
        replace(spec, heads=3)


def test_replace_leaves_a_dataclass_with_post_init_to_dataclasses() -> None:
    @dataclasses.dataclass(frozen=True)
    class Checked:
        size: int

        def __post_init__(self) -> None:
            if self.size < 0:
                raise ValueError("negative")

    assert replace(Checked(1), size=2) == Checked(2)
    with pytest.raises(ValueError, match="negative"):
        replace(Checked(1), size=-1)


def test_replace_carries_fields_only() -> None:
    import functools

    @dataclasses.dataclass(frozen=True)
    class Sized:
        blocks: int

        @functools.cached_property
        def doubled(self) -> int:
            return 2 * self.blocks

    small = Sized(2)
    assert small.doubled == 4
    assert replace(small, blocks=5).doubled == 10
