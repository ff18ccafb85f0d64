"""The DecodeBench connector at its fill: vLLM's own benchmark connector fills a request's blocks of the walk's caches
with dummy values, and the bytes it changed are held against the bytes those blocks own.

What runs is vLLM's: `DecodeBenchConnector` (vllm/distributed/kv_transfer/kv_connector/v1/decode_bench_connector.py),
built for the worker role by its own constructor (which builds its `DecodeBenchConnectorWorker`), its
`register_kv_caches` on the runner's caches (the caches connectors get, KV-sharing layers mapped to their target's), then
the scheduler's metadata (`DecodeBenchConnectorMetadata`: one request, its manager block ids per KV-cache group, as the
scheduler side's `update_state_after_alloc` hands them over) bound with `bind_connector_metadata` and run through
`start_load_kv`, the entry the metadata reaches in the runner: `start_fill_kv` -> `_fill_blocks` -> `_fill_block_tensor`
(per layer, the block rows of its cache). What is stood in is outside that code:

- the connector's settings (a KVTransferConfig for DecodeBenchConnector, its default fill) and the user's cache dtype;
- the runner's forward context, which the fill does not read (the layers as bound, no attention metadata).

The connector's config is the KVCacheConfig as planned (the worker builds connectors before the runner adds KV-sharing
layers to their targets' groups). A case on a backend that does not support KV connectors is skipped: vLLM's selector
never picks it while a connector is configured.

The fill runs twice, once on buffers of all 0x00 bytes and once on all 0xFF: a byte it writes differs from one of them
whatever it writes (its zeros for packed and circular-buffer caches included), so the bytes changed in either run are
exactly the bytes it wrote.

The judgement (oracles/touch.py): every content byte of each asked block in the layers of the group it was asked for is
written (`fill-miss`), and no byte outside those blocks' content and their own padding changed (`fill-stray`). The ids
are manager block ids (the scheduler's); a manager block of several kernel blocks owns all of them.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import types
from collections.abc import Iterator
from typing import Any

from fuzz.case import Case
from fuzz.checks import nixl
from fuzz.checks.protocol import Judging, Off, Record, Run, TouchCheck, Unusable
from fuzz.verdict.findings import Finding, observed
from oracles import touch
from oracles.expectation import Expectation

MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector"
# The two fills of the buffers before each run: any byte value differs from at least one of them.
PREFILLS = (0x00, 0xFF)
REQUEST = "kvfuzz-req"


def connector_module() -> types.ModuleType | None:
    try:
        module = importlib.import_module(MODULE)
    except ImportError:
        return None
    return module if hasattr(module, "DecodeBenchConnector") else None


def fill_function(module: types.ModuleType) -> str:
    """The worker's method that writes a layer's block rows: `_fill_block_tensor` (0.29+), inline in `_fill_blocks` before."""
    return "_fill_block_tensor" if hasattr(module.DecodeBenchConnectorWorker, "_fill_block_tensor") else "_fill_blocks"


def supports_hma(cls: type) -> bool:
    """Whether the connector declares SupportsHMA (vLLM keeps the hybrid KV-cache manager, and several groups, for it)."""
    return any(klass.__name__ == "SupportsHMA" for klass in cls.__mro__)


def asked_blocks(case: Case, groups: int) -> list[list[int]]:
    """The manager blocks the request fills in each KV-cache group: the case's blocks (the null block aside), in group k
    each shifted k blocks on, so that the groups of one request fill different blocks (BlockPool hands each group its
    own), except where the pool has too few blocks."""
    touches = case.touches
    drawn = [block for block in (touches.blocks if touches else ()) if block]
    base = drawn or list(range(1, min(case.num_blocks, 3)))
    if not base:
        raise Unusable("a pool of one block holds only the null block, which vLLM never hands a connector to fill")
    usable = case.num_blocks - 1  # blocks 1 .. num_blocks - 1
    return [sorted({1 + (block - 1 + k) % usable for block in base}) for k in range(groups)]


def connector_config(walk: Any) -> Any:
    """The KVCacheConfig a worker builds its connector with: the one it was planned, before the runner adds the KV-sharing
    layers to their targets' groups (0.32.0 gpu_worker.py initialize_from_config: ensure_kv_transfer_initialized runs
    before initialize_kv_cache, "because `initialize_kv_cache` will inject kv cache groups not related to kv cache
    connector (e.g. kv cache sharing layers)"); the walk's config is the runner's, sharers added."""
    sharers = {sharer for sharer, _ in walk.case.kv_sharing}
    if not sharers:
        return walk.config
    planned = copy.deepcopy(walk.config)
    for group in planned.kv_cache_groups:
        group.layer_names = [name for name in group.layer_names if name not in sharers]
    for attribute, value in vars(type(planned)).items():  # what the config derived from the groups, derived again
        if isinstance(value, functools.cached_property):
            planned.__dict__.pop(attribute, None)
    return planned


def refuses_connectors(walk: Any) -> None:
    """Raises Unusable where a layer's backend says it does not support KV connectors: vLLM's attention selector never
    picks such a backend while one is configured (0.32.0 vllm/v1/attention/backend.py validate_configuration: "KV
    connector not supported")."""
    from fuzz.targets import consumers

    for backend in set(consumers.layer_backends(walk).values()):
        if hasattr(backend, "supports_kv_connector") and not backend.supports_kv_connector():
            raise Unusable(f"{backend.get_name()} does not support KV connectors: vLLM picks another backend while one is configured")


@contextlib.contextmanager
def stand_ins(walk: Any) -> Iterator[list[str]]:
    """The connector's settings and the user's cache dtype, while it is built and fills (see the module's doc)."""
    config = walk.vllm_config
    transfer_config = importlib.import_module("vllm.config").KVTransferConfig(kv_connector="DecodeBenchConnector", kv_role="kv_both")
    cache_dtype = next((g.spec.cache_dtype for g in walk.case.groups if g.spec.kind != "mamba"), "auto")
    with nixl._attribute(config, "kv_transfer_config", transfer_config), nixl._attribute(config.cache_config, "cache_dtype", cache_dtype):
        yield ["vllm_config.kv_transfer_config (--kv-transfer-config DecodeBenchConnector)", "the runner's forward context"]


def forward_context(walk: Any) -> Any:
    """Stands in for the runner's ForwardContext at start_load_kv: the layers holding the caches they bound, no attention
    metadata (the fill reads none of it)."""
    from fuzz.targets.consumers import LayerStub

    return types.SimpleNamespace(no_compile_layers={name: LayerStub(view) for name, view in walk.bound_views.items()}, attn_metadata=None)


def fill(module: types.ModuleType, walk: Any) -> Record:
    """vLLM's connector built, registered and run on one request's blocks (`asked_blocks`): what it was asked, per
    group, and every byte it wrote."""
    from fuzz.targets import readback
    from fuzz.targets.consumers import with_sharers

    refuses_connectors(walk)
    cls = module.DecodeBenchConnector
    config = connector_config(walk)
    groups = list(config.kv_cache_groups)
    if not groups:
        raise Unusable("an attention-free model has no KV-cache group to fill")
    if len(groups) > 1 and not supports_hma(cls):
        raise Unusable(f"{cls.__name__} does not declare SupportsHMA: vLLM turns the hybrid KV-cache manager off for it and "
                       "plans one KV-cache group")
    asked = asked_blocks(walk.case, len(groups))
    block_size = walk.case.groups[0].spec.block_size
    metadata = module.DecodeBenchConnectorMetadata(reqs_to_fill={REQUEST: (tuple(list(b) for b in asked), len(asked[0]) * block_size)})
    written: list[list[int]] = []
    with stand_ins(walk) as replaced:
        connector = cls(walk.vllm_config, module.KVConnectorRole.WORKER, config)
        connector.register_kv_caches(with_sharers(walk))
        connector.bind_connector_metadata(metadata)
        for prefill in PREFILLS:
            readback.fill(walk.raw, prefill)
            before = readback.snapshot(walk.raw)
            connector.start_load_kv(forward_context(walk))
            written += readback.changed(walk.raw, before)
    return {"replaced": replaced, "written": written,
            "asked": [{"group": index, "layers": list(group.layer_names), "blocks": blocks}
                      for index, (group, blocks) in enumerate(zip(groups, asked, strict=True))]}


# ------------------------------------------------------------------------------------------- the judgement


def as_bytes(rows: list[list[int]], buffers: dict[int, int]) -> touch.Bytes:
    """[buffer, start, end] rows of vLLM's buffers as a byte set of the oracle's."""
    return touch.union(*({buffers.get(buffer, buffer): touch.Spans.of([start], [end])} for buffer, start, end in rows)) if rows else {}


def asked_content(expected: Expectation, record: Record) -> touch.Bytes:
    """The content bytes the request's blocks own in the layers of the groups they were asked for."""
    return touch.union(*(touch.owned(expected, [layer], block) for layer, block in asked_pairs(expected, record)))


def owner_of(expected: Expectation, byte_set: touch.Bytes, pairs: list[tuple[str, int]]) -> tuple[str, int] | None:
    """The first of the (layer, manager block) pairs whose content holds the set's first byte, if any does."""
    buffer = min(byte_set)
    first = {buffer: touch.Spans.of([byte_set[buffer].first], [byte_set[buffer].first + 1])}
    return next(((layer, block) for layer, block in pairs if touch.meets(first, touch.owned(expected, [layer], block))), None)


def asked_pairs(expected: Expectation, record: Record) -> list[tuple[str, int]]:
    cache = set(touch.cache_layers(expected))
    return [(layer, block) for entry in record["asked"] for layer in entry["layers"] if layer in cache for block in entry["blocks"]]


def _describe(byte_set: touch.Bytes) -> str:
    buffer = min(byte_set)
    return f"{touch.count(byte_set)} bytes, the first at byte {byte_set[buffer].first} of buffer {buffer}"


def judge_fill(judging: Judging, record: Record, function: str) -> Finding | None:
    case, expected = judging.case, judging.expected
    assert expected is not None
    written = as_bytes(record["written"], nixl.buffer_map(judging))
    content = asked_content(expected, record)
    blocks = sorted({block for entry in record["asked"] for block in entry["blocks"]})
    # A block is one group's at a time (contract.block_id_held_by_one_group): every byte its tile holds in the pool the
    # groups share is the asking group's to write, another group's layer's page of that block included.
    tiles = touch.union(*(touch.tile(case, expected, block) for block in blocks))
    asked = f"{record['where']}: filling {len(blocks)} block(s) of {len(record['asked'])} group(s)"
    stray = touch.minus(written, touch.union(content, tiles))
    if stray:
        owner = owner_of(expected, stray, [(layer, block) for layer in touch.cache_layers(expected) for block in range(case.num_blocks)])
        if owner is None:
            return observed(case, "fill-stray", function, f"{asked}: changed {_describe(stray)}, which no block's content holds")
        layer, block = owner
        # Asked in another group's layers only: the request's block of this group is another.
        whose = "a block asked for another group" if block in blocks else "a block it was not asked to fill"
        return observed(case, "fill-stray", function, f"{asked}: changed {_describe(stray)}, in {whose} (block {block} of layer "
                                                      f"{layer})", layer)
    missed = touch.minus(content, written)
    if missed:
        owner = owner_of(expected, missed, asked_pairs(expected, record))
        assert owner is not None  # the asked content is an asked layer's block's
        return observed(case, "fill-miss", function, f"{asked}: left {_describe(missed)} of block {owner[1]} of layer {owner[0]} "
                                                     "unwritten", owner[0])
    return None


# ------------------------------------------------------------------------------------------- the check


class DecodeBenchCheck(TouchCheck):
    """DecodeBench's fill of a request's blocks (see the module's doc)."""

    name = "decode-bench"
    drawn = True
    setting = "--kv-transfer-config '{\"kv_connector\": \"DecodeBenchConnector\", \"kv_role\": \"kv_both\"}'"
    reads_buffers = False  # it fills every buffer itself before each run
    kinds = {
        "fill-stray": "a connector filling a request's KV blocks changed bytes outside those blocks' content and padding",
        "fill-miss": "a connector filling a request's KV blocks left bytes of their content unwritten",
    }

    def offer(self, probe: Any) -> Run | Off | None:
        module = connector_module()
        if module is None:
            return None
        if probe.find("allocation") is None:
            return Off(f"{MODULE}: kvfuzz drives its fill on the per-layer [B, H, N, C] caches of 0.29+ (allocate_kv_cache); "
                       "the backend-shaped caches before (a K/V axis first on some backends) are not triaged")
        from fuzz.targets import consumers  # torch and vLLM: the worker's, never the coordinator's

        where = f"{MODULE}.DecodeBenchConnectorWorker.{fill_function(module)}"

        def run(walk: Any, touches: Any) -> Record:
            return fill(module, walk)

        return consumers.consumer_run("filling", where, consumers.runners_calling(r"\bregister_kv_caches\("), run)

    def judge(self, judging: Judging, record: Record) -> Finding | None:
        if "skipped" in record or judging.expected is None:
            return None
        function = record["where"].rsplit(".", 1)[-1]
        if "error" in record:
            error = record["error"]
            kind = "refused-valid" if error["type"] in nixl.REFUSALS else "crash-on-valid"
            return observed(judging.case, kind, error.get("function") or function, f"{record['where']}: {error['type']}: {error['message']}")
        return judge_fill(judging, record, function)


CHECK = DecodeBenchCheck()
