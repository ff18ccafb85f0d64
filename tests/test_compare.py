"""The comparator's arithmetic classification agrees with byte-by-byte enumeration.

Production-sized caches cannot be enumerated, so the comparator decides alias, page escape and
block cover on strided layouts alone. Here thousands of small random layouts (the oracle's views
of random cases, with their geometry perturbed) are classified both ways."""

import dataclasses
import random
from collections import Counter

import numpy as np

from fuzz.space import Rejected, draw_indexed
from fuzz.verdict.compare import block_layout, classify
from oracles import expect
from oracles.contract import LAYOUT_PLACED_KERNEL_MAP, SHAPED_022
from oracles.strided import Strided, byte_addresses
from tests.conftest import synthetic_info

SHAPES = {"A": ("B", 2, "T", "H", "D"), "M": ("B", "T", "D")}


def distinct(values: np.ndarray) -> np.ndarray:
    ordered = np.sort(values)
    return ordered[np.concatenate(([True], ordered[1:] != ordered[:-1]))] if ordered.size else ordered


def reference(layer, want, actual: Strided) -> str:
    """The classification by enumeration: every element, every byte."""
    addresses = byte_addresses(actual)
    if distinct(addresses).size != addresses.size:
        return "alias"
    if actual.shape != want.shape:
        return "shape"
    expected = Strided(want.shape, want.byte_strides, want.byte_offset, want.element_size)
    for block in range(-(-want.shape[want.block_axis] // want.kernel_stride)):
        mine = byte_addresses(block_layout(actual, want, block))
        spans, padding = layer.pages.spans(block), layer.pages.padding(block)
        inside = np.zeros(mine.shape, bool)
        for lo, hi in spans:
            inside |= (mine >= lo) & (mine < hi)
        touched = any(((mine >= lo) & (mine < hi)).any() for lo, hi in padding)
        if not inside.all() or (touched and not layer.addresses_padding):
            return "page-escape"
        if not np.array_equal(distinct(mine), distinct(byte_addresses(block_layout(expected, want, block)))):
            return "block-partition"
    return "order"


def targets():
    placed = synthetic_info()
    shaped = synthetic_info(SHAPED_022, ("NHD", "HND"))
    shaped = dataclasses.replace(shaped, spec_kinds=tuple(k for k in shaped.spec_kinds if k != "encoder_only"))
    return [(placed, LAYOUT_PLACED_KERNEL_MAP), (shaped, SHAPED_022)]


def perturb(rng: random.Random, want) -> Strided:
    shape, strides, offset = list(want.shape), list(want.byte_strides), want.byte_offset
    for _ in range(rng.randint(1, 3)):
        i, j = rng.randrange(len(shape)), rng.randrange(len(shape))
        move = rng.choice(("swap", "scale", "shift", "zero", "resize", "halve"))
        if move == "swap":
            strides[i], strides[j] = strides[j], strides[i]
        elif move == "scale":
            strides[i] *= rng.choice((2, 3))
        elif move == "shift":
            offset += rng.choice((want.element_size, 64, want.byte_strides[want.block_axis]))
        elif move == "zero":
            strides[i] = 0
        elif move == "resize":
            shape[i] = max(1, shape[i] + rng.choice((-1, 1)))
        else:
            strides[i] = max(want.element_size, strides[i] // 2)
    return Strided(tuple(shape), tuple(strides), offset, want.element_size)


def test_arithmetic_classification_agrees_with_enumeration():
    rng = random.Random(2024)
    checked, kinds = 0, Counter()
    for index in range(2000):
        info, contract = targets()[index % 2]
        try:
            case = draw_indexed(info, 9, index)
        except Rejected:
            continue
        if not contract.layout_placed:
            case = dataclasses.replace(case, groups=tuple(
                dataclasses.replace(g, declared_shape=SHAPES[g.backend]) if g.backend else g for g in case.groups))
        expectation = expect(case, contract)
        if not expectation.accepted:
            continue
        layer = expectation.layers[rng.choice(sorted(expectation.layers))]
        want = rng.choice(layer.views)
        actual = perturb(rng, want)
        if actual.numel * actual.item > 1 << 20:
            continue
        kind = classify(layer, want, actual)[0]
        assert kind == reference(layer, want, actual), (case, want, actual)
        checked += 1
        kinds[kind] += 1
    assert checked > 1000
    assert set(kinds) >= {"alias", "shape", "page-escape", "block-partition", "order"}, kinds


def test_production_sized_cache_is_classified_without_enumerating():
    # A DeepSeek V4 indexer cache at the size that crashed in production: 30,819 blocks of 1728 B.
    from fuzz.case import SpecCase
    from tests.conftest import one_group
    from tests.test_shaped_oracle import LATENT

    spec = SpecCase(kind="mla", block_size=256, head_size=584, dtype="uint8", alignment=576, compress_ratio=128, model_version="deepseek_v4")
    expectation = expect(one_group(spec, layout="NHD", blocks=30819, kernel=2, backend=LATENT), SHAPED_022)
    layer = expectation.layers["l0"]
    want = layer.views[0]
    assert want.shape == (30819, 2, 584)
    swapped = Strided(want.shape, (1728, 1, 584), 0, 1)  # slots and bytes transposed: elements collide
    assert classify(layer, want, swapped)[0] == "alias"
    unpadded = Strided(want.shape, (1168, 584, 1), 0, 1)  # blocks packed as if there were no padding
    assert classify(layer, want, unpadded)[0] == "page-escape"


def test_errors_are_judged_by_whether_the_contract_expresses_the_case():
    """A refusal of a case the contract expresses is refused-valid; vLLM promises a ValueError with a message for a case
    it cannot express, so an assertion there is assert-on-invalid and any other error crash-on-invalid."""
    from fuzz.case import SpecCase
    from fuzz.targets.base import Outcome
    from fuzz.verdict.compare import compare
    from tests.conftest import one_group

    valid = one_group(SpecCase(kind="full", block_size=16, num_kv_heads=2, head_size=64, dtype="float16"))
    # 128 tokens per stored state cannot be cut into kernel blocks of 16 tokens.
    compressed = SpecCase(kind="mla", block_size=256, head_size=584, dtype="uint8", compress_ratio=128, model_version="deepseek_v4")
    invalid = one_group(compressed, kernel=16)
    accepted, refused = expect(valid, LAYOUT_PLACED_KERNEL_MAP), expect(invalid, LAYOUT_PLACED_KERNEL_MAP)
    assert accepted.accepted and not refused.accepted

    def judge(case, expectation, error_type):
        verdict = compare(case, expectation, Outcome(error_type=error_type, error_message="out of bounds 12", error_function="f"))
        return verdict.status, verdict.finding.kind if verdict.finding else None

    assert judge(valid, accepted, "ValueError") == ("finding", "refused-valid")
    assert judge(valid, accepted, "NotImplementedError") == ("finding", "refused-valid")
    assert judge(valid, accepted, "AssertionError") == ("finding", "crash-on-valid")
    assert judge(valid, accepted, "RuntimeError") == ("finding", "crash-on-valid")
    assert judge(invalid, refused, "ValueError") == ("rejected", None)
    assert judge(invalid, refused, "NotImplementedError") == ("rejected", None)
    assert judge(invalid, refused, "AssertionError") == ("finding", "assert-on-invalid")
    assert judge(invalid, refused, "RuntimeError") == ("finding", "crash-on-invalid")
    assert judge(invalid, refused, "ZeroDivisionError") == ("finding", "crash-on-invalid")
    assert judge(invalid, refused, "IndexError") == ("finding", "crash-on-invalid")
