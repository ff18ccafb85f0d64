"""Who owns each byte of a raw KV-cache buffer, as the oracle expects it and as vLLM built it.

Every byte of a raw buffer gets an owner (layer, tensor, K or V, manager block, kernel block)
from the views that address it, packed into one int64 code. `expected_tensors` and
`actual_tensors` enumerate the owned elements of each side's views; `byte_map` lays them onto one
buffer and marks page padding, bytes that layers of different groups share, and clashes (two
elements on one byte, or elements of different blocks). Everything is vectorized with numpy;
nothing loops over bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fuzz.case import Case, SpecCase
from fuzz.targets.base import Outcome, ViewRecord
from fuzz.verdict.compare import element_offsets
from oracles.expectation import Expectation, ViewExpectation

ELEMENT_LIMIT = 1 << 24  # tensors beyond this many elements are left out of the maps
OVERFLOW_LIMIT = 1 << 22  # bytes past a buffer's end that a map still shows

# Owner codes pack (layer, tensor, kv, block, kernel block within its manager block) into an int64.
_FIELDS = (("layer", 12, 52), ("tensor", 4, 48), ("kv", 2, 46), ("block", 26, 20), ("sub", 20, 0))
KV_NAMES = {0: "", 1: "K", 2: "V"}


@dataclass(frozen=True)
class Tensor:
    """One tensor's owned elements on one raw buffer: first byte, row-major index and owner of each."""

    layer: str
    layer_index: int
    group: int
    tensor: int
    buffer: int
    shape: tuple[int, ...]
    byte_strides: tuple[int, ...]
    offset: int
    dtype: str
    element_size: int
    starts: np.ndarray
    index: np.ndarray
    blocks: np.ndarray
    kernel: np.ndarray
    kv: np.ndarray

    @property
    def codes(self) -> np.ndarray:
        sub = np.where(self.blocks >= 0, self.kernel, 0)
        return pack_owner(self.layer_index, self.tensor, self.kv, np.maximum(self.blocks, 0), sub)

    def byte_addresses(self) -> np.ndarray:
        return (self.starts[:, None] + np.arange(self.element_size, dtype=np.int64)[None, :]).reshape(-1)

    def describe(self, key: int) -> str:
        """The owner of byte `key % element_size` of element `key // element_size`, in words."""
        element, byte = divmod(int(key), self.element_size)
        at = int(np.searchsorted(self.index, element))
        where = tuple(int(i) for i in np.unravel_index(element, self.shape))
        kv = KV_NAMES[int(self.kv[at])]
        return (f"{self.layer}[{self.tensor}]{' ' + kv if kv else ''} element {where} byte {byte} "
                f"(block {int(self.blocks[at])}, its kernel block {int(self.kernel[at])})")


def pack_owner(layer: int, tensor: int, kv: np.ndarray, block: np.ndarray, sub: np.ndarray) -> np.ndarray:
    """Owner codes: each field masked to its width and shifted into its place (see _FIELDS)."""
    values = {"layer": layer, "tensor": tensor, "kv": kv, "block": block, "sub": sub}
    code = np.zeros(np.shape(kv), dtype=np.int64)
    for name, bits, shift in _FIELDS:
        code |= (np.asarray(values[name], dtype=np.int64) & ((1 << bits) - 1)) << shift
    return code


def unpack_owner(code: int) -> dict[str, int]:
    """The fields of one owner code, by name."""
    return {name: (int(code) >> shift) & ((1 << bits) - 1) for name, bits, shift in _FIELDS}


def _axis_index(shape: tuple[int, ...], axis: int) -> np.ndarray:
    """Each element's index along `axis`, row-major."""
    view = [1] * len(shape)
    view[axis] = -1
    return np.broadcast_to(np.arange(shape[axis], dtype=np.int64).reshape(view), shape).reshape(-1)


def _spec_of(case: Case, layer: str) -> SpecCase | None:
    owner = dict(case.kv_sharing).get(layer, layer)
    try:
        return case.groups[case.group_of(owner)].spec
    except KeyError:
        return None


def _kv_labels(case: Case, layer: str, shape: tuple[int, ...], block_axis: int) -> np.ndarray:
    """1 for K and 2 for V along a size-2 K/V axis (one of the two outermost), else 0."""
    spec = _spec_of(case, layer)
    if spec is not None and spec.is_attention and not spec.is_mla:
        for axis in (0, 1):
            if axis < len(shape) and axis != block_axis and shape[axis] == 2:
                return _axis_index(shape, axis) + 1
    return np.zeros(math.prod(shape), dtype=np.int64)


def _group_index(case: Case, layer: str) -> int:
    try:
        return case.group_of(dict(case.kv_sharing).get(layer, layer))
    except KeyError:
        return -1


def expected_tensors(case: Case, expectation: Expectation | None) -> list[Tensor]:
    """The owned elements of every view the oracle expects (none when it rejects the case)."""
    if expectation is None or not expectation.accepted:
        return []
    tensors = []
    names = case.layer_names
    for name, layer in expectation.layers.items():
        if name in expectation.kv_sharing:
            continue
        for number, view in enumerate(layer.views):
            if math.prod(view.shape) > ELEMENT_LIMIT:
                continue
            offsets = view.element_offsets()
            owned = offsets >= 0
            tensors.append(Tensor(
                name, names.index(name) if name in names else len(names), layer.group, number, view.buffer, view.shape,
                view.byte_strides, view.byte_offset, view.dtype, view.element_size, offsets[owned], np.flatnonzero(owned),
                view.element_blocks()[owned], _axis_index(view.shape, view.block_axis)[owned] % view.kernel_stride,
                _kv_labels(case, name, view.shape, view.block_axis)[owned]))
    return tensors


def _block_geometry(case: Case, view: ViewRecord, want: ViewExpectation | None) -> tuple[int, int, int]:
    """(block axis, kernel ratio, kernel stride) of an actual view: the expected view's when the
    shapes agree, else a guess that spreads the block axis evenly over the manager blocks."""
    if want is not None and want.shape == view.shape:
        return want.block_axis, want.kernel_ratio, want.kernel_stride
    blocks = case.num_blocks
    if want is not None and len(want.shape) == len(view.shape):
        axis = want.block_axis
    else:
        fits = [a for a, size in enumerate(view.shape) if size >= blocks and size % blocks == 0]
        axis = max(fits, key=lambda a: abs(view.stride[a])) if fits else 0
    per = max(1, view.shape[axis] // blocks) if view.shape else 1
    return axis, per, per


def actual_tensors(case: Case, expectation: Expectation | None, outcome: Outcome | None) -> list[Tensor]:
    """The owned elements of every view vLLM built, layers that share another's cache left out."""
    if outcome is None:
        return []
    sharers = set(dict(case.kv_sharing)) | set(outcome.aliases)
    layers = expectation.layers if expectation is not None and expectation.accepted else {}
    tensors = []
    for name, views in outcome.views.items():
        if name in sharers:
            continue
        wanted = layers[name].views if name in layers else ()
        for number, view in enumerate(views):
            tensor = view_tensor(case, name, number, view, wanted[number] if number < len(wanted) else None)
            if tensor is not None:
                tensors.append(tensor)
    return tensors


def view_tensor(case: Case, name: str, number: int, view: ViewRecord, want: ViewExpectation | None) -> Tensor | None:
    """The owned elements of one view vLLM built (or tried to), None when they cannot be enumerated."""
    if view.buffer < 0 or not view.shape or math.prod(view.shape) > ELEMENT_LIMIT:
        return None
    names = case.layer_names
    axis, ratio, stride = _block_geometry(case, view, want)
    kernel = _axis_index(view.shape, axis)
    owned = kernel % stride < ratio
    return Tensor(name, names.index(name) if name in names else len(names), _group_index(case, name), number, view.buffer,
                  view.shape, view.byte_strides, view.offset_bytes, view.dtype, view.element_size, element_offsets(view)[owned],
                  np.flatnonzero(owned), (kernel // stride)[owned], (kernel % stride)[owned], _kv_labels(case, name, view.shape, axis)[owned])


@dataclass(frozen=True)
class ByteMap:
    """Owners of every byte of one raw buffer, as one side (oracle or vLLM) sees them. The arrays
    run past the buffer's end when a view reaches further (up to OVERFLOW_LIMIT bytes)."""

    end: int  # the buffer's size
    owner: np.ndarray  # packed owner code, -1 where no element lies
    under: np.ndarray  # the other owner of a byte that layers of different groups share, else -1
    clash: np.ndarray  # two elements, elements of different blocks, or two layers of one group
    shared: np.ndarray  # layers of different groups, block for block (hybrid pages share bytes)
    padding: np.ndarray  # page padding that no expected element uses
    outside: tuple[tuple[str, int, int], ...]  # (layer, lowest, highest + 1) of bytes off the buffer

    @property
    def size(self) -> int:
        """Bytes mapped: the buffer and what views address past its end."""
        return int(self.owner.size)


def byte_map(tensors: list[Tensor], end: int, padding: np.ndarray | None = None) -> ByteMap:
    """Lay these tensors onto one buffer of `end` bytes; `padding` marks the bytes page rules call padding."""
    reach = max([end] + [int(t.starts.max()) + t.element_size for t in tensors if t.starts.size])
    size = min(reach, end + OVERFLOW_LIMIT)
    owner = np.full(size, -1, dtype=np.int64)
    under = np.full(size, -1, dtype=np.int64)
    block = np.full(size, -1, dtype=np.int32)
    group = np.full(size, -1, dtype=np.int32)
    clash = np.zeros(size, dtype=bool)
    shared = np.zeros(size, dtype=bool)
    outside = []
    for tensor in tensors:
        addresses = tensor.byte_addresses()
        codes = np.repeat(tensor.codes, tensor.element_size)
        blocks = np.repeat(tensor.blocks, tensor.element_size).astype(np.int32)
        off = addresses[(addresses < 0) | (addresses >= end)]
        if off.size:
            outside.append((tensor.layer, int(off.min()), int(off.max()) + 1))
        inside = (addresses >= 0) & (addresses < size)
        if not inside.all():
            addresses, codes, blocks = addresses[inside], codes[inside], blocks[inside]
        clash |= np.bincount(addresses, minlength=size)[:size] > 1
        before_block, before_group = block[addresses], group[addresses]
        taken = owner[addresses] >= 0
        clash[addresses[taken & ((before_block != blocks) | (before_group == tensor.group))]] = True
        hybrid = addresses[taken & (before_group != tensor.group) & (before_block == blocks)]
        shared[hybrid] = True
        under[hybrid] = owner[hybrid]
        owner[addresses] = codes
        block[addresses] = blocks
        group[addresses] = tensor.group
    pad = np.zeros(size, dtype=bool)
    if padding is not None:
        pad[:min(size, padding.size)] = padding[:size]
        pad &= owner < 0
    return ByteMap(end, owner, under, clash, shared, pad, tuple(outside))


def padding_mask(expectation: Expectation | None, buffer: int, size: int, num_blocks: int) -> np.ndarray:
    """Bytes that some layer's page rule calls padding, on one expected buffer."""
    edges = np.zeros(size + 1, dtype=np.int64)
    if expectation is None or not expectation.accepted:
        return np.zeros(size, dtype=bool)
    for name, layer in expectation.layers.items():
        rule = layer.pages
        if name in expectation.kv_sharing or not layer.views or layer.views[0].buffer != buffer or rule.pad_start >= rule.span_len:
            continue
        bases = rule.origin + np.arange(num_blocks, dtype=np.int64) * rule.block_pitch
        starts = (bases[:, None] + np.asarray(rule.span_starts, dtype=np.int64)[None, :] + rule.pad_start).reshape(-1)
        ends = starts + (rule.span_len - rule.pad_start)
        np.add.at(edges, np.clip(starts, 0, size), 1)
        np.add.at(edges, np.clip(ends, 0, size), -1)
    return np.cumsum(edges[:-1]) > 0


def pair_buffers(expected: list[Tensor], actual: list[Tensor]) -> dict[int, int]:
    """Actual buffer index -> expected buffer index, through the layers each holds."""
    where = {(t.layer, t.tensor): t.buffer for t in expected}
    pairs: dict[int, int] = {}
    for tensor in actual:
        if (tensor.layer, tensor.tensor) in where:
            pairs.setdefault(tensor.buffer, where[(tensor.layer, tensor.tensor)])
    return pairs

