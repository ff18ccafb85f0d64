"""The ExampleConnector's save and load, played: vLLM's own example connector saves a request's blocks of the case's
caches to files, and loads them into other blocks of a second, freshly filled copy of the caches; the receiver must then
hold the sender's K and V for every layer and token saved, and nothing else of it may change.

What runs is vLLM's: `ExampleConnector` (vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py), built for
the worker role by its own constructor at each end, with the metadata it reads built through its own classes
(`ExampleConnectorMetadata.add_request`, whose `ReqMeta.make_meta` works out the slot mapping from the block ids and the
block size): on the sender `save_kv_layer` for each layer (its `extract_kv_from_layer`, the file written with
safetensors), on the receiver `start_load_kv` (its `inject_kv_into_layer`). Each layer's cache is the one the runner binds
to it (a layer's `kv_cache`: kernel-block views from 0.32, an MLA layer's as `MLAAttention.bind_kv_cache` binds it), as
the attention layer hands it to the connector (`maybe_transfer_kv_layer` through `get_attention_context`). What is stood
in is outside that code:

- the connector's settings (a KVTransferConfig for ExampleConnector whose `shared_storage_path` is a temporary folder)
  and the user's --block-size (the case's: the walk's config holds another case's);
- the runner's forward context (the layers as bound, the attention metadata by layer) and that metadata: the connector
  only asks whether it is MLA's (`isinstance(attn_metadata, MLACommonMetadata)`), so an MLA layer gets an instance,
  made without its fields, of the class its backend's builder declares (MLACommonMetadata where it declares none), any
  other layer a plain object.

The ids are manager block ids (the scheduler's `new_req.block_ids[0]`), the block size the user's. The sender's blocks
are the case's (the null block aside); the receiver's are others of the second copy, from its last block down. Judged as
a played transfer of the NIXL check (`nixl.compare_ends`, `nixl.judge_played`): every saved token holds the sender's K
and V in each layer and head of the receiver (`transfer-wrong`), and no byte of the receiver outside the receiving blocks
changed (`transfer-stray`).
"""

from __future__ import annotations

import contextlib
import importlib
import tempfile
import types
import typing
from collections.abc import Iterator
from typing import Any

from fuzz.case import MLA_KINDS, Case
from fuzz.checks import nixl
from fuzz.checks.decode_bench import connector_config, refuses_connectors
from fuzz.checks.nixl import End
from fuzz.checks.protocol import Judging, Off, Record, Run, TouchCheck, Unusable
from fuzz.errors import BrokenDeclaration, CaseMismatch, Inexpressible
from fuzz.verdict.findings import Finding, observed
from oracles import transfer

MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.example_connector"
# Without SupportsHMA vLLM turns the hybrid KV-cache manager off for the connector (0.32.0 vllm/config/vllm.py: "Turning
# off hybrid kv cache manager because `--kv-transfer-config` selects a KV connector that does not support it"), and
# get_kv_cache_groups then plans one group (sliding-window layers promoted to full attention; hybrid SSM models "will fail
# at startup without it").
ONE_GROUP_RULE = ("ExampleConnector does not declare SupportsHMA: vLLM turns the hybrid KV-cache manager off for it and plans "
                  "one KV-cache group")


def connector_class() -> type | None:
    try:
        module = importlib.import_module(MODULE)
    except ImportError:
        return None
    return getattr(module, "ExampleConnector", None)


def receiving_blocks(num_blocks: int, sent: list[int]) -> list[int]:
    """As many blocks as `sent`, others where the pool has them: from the last block down, the null block never."""
    others = [block for block in range(num_blocks - 1, 0, -1) if block not in sent]
    return (others + [block for block in sent if block not in others])[: len(sent)]


def sent_blocks(case: Case) -> list[int]:
    touches = case.touches
    sent = [block for block in (touches.blocks if touches else ()) if block] or list(range(1, min(case.num_blocks, 3)))
    if not sent:
        raise Unusable("a pool of one block holds only the null block, which holds no request's tokens")
    return sent


@contextlib.contextmanager
def stand_ins(walk: Any, folder: str) -> Iterator[list[str]]:
    """The connector's settings and the user's block size, while a connector is built and runs (see the module's doc)."""
    config = walk.vllm_config
    transfer_config = importlib.import_module("vllm.config").KVTransferConfig(
        kv_connector="ExampleConnector", kv_role="kv_both", kv_connector_extra_config={"shared_storage_path": folder})
    with nixl._attribute(config, "kv_transfer_config", transfer_config), \
            nixl._attribute(config.cache_config, "block_size", nixl.tokens_per_block(walk)):
        yield ["vllm_config.kv_transfer_config (--kv-transfer-config ExampleConnector, a temporary shared_storage_path)",
               "cache_config.block_size (the user's --block-size: the case's)", "the runner's forward context",
               "the attention metadata (an MLA layer's: the class its backend builds, made without its fields)"]


def declared_metadata(backend: type) -> type | None:
    """The attention metadata class a backend's builder declares it builds (its `metadata_cls`, or the class its
    AttentionMetadataBuilder[M] is made for), or None where the backend states no builder (one kvfuzz made up)."""
    try:
        builder = backend.get_builder_cls()
    except NotImplementedError:
        return None
    declared = getattr(builder, "metadata_cls", None)
    if isinstance(declared, type):
        return declared
    for klass in builder.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            for argument in typing.get_args(base):
                found = argument.__bound__ if isinstance(argument, typing.TypeVar) else argument
                if isinstance(found, type):
                    return found
    return None


def mla_metadata(module: types.ModuleType, name: str, backend: type | None) -> Any:
    """An MLA layer's attention metadata as its backend's builder makes it, without its fields: of the class the builder
    declares, MLACommonMetadata where it declares none."""
    common = module.MLACommonMetadata
    declared = declared_metadata(backend) if backend is not None else None
    if declared is not None and not issubclass(declared, common):
        # DeepSeek V4's backends build metadata of their own, for models of several KV-cache groups (ONE_GROUP_RULE).
        raise Unusable(f"{name}'s backend builds {declared.__name__}, not MLA's common metadata: kvfuzz plays ExampleConnector "
                       "on MLA backends of MLACommonMetadata only")
    return object.__new__(declared or common)


def forward_context(module: types.ModuleType, walk: Any, mla_layer: type | None) -> Any:
    """Stands in for the runner's ForwardContext: the layers as bound, and each layer's attention metadata, which the
    connector only tests for MLA's class (`mla_metadata` for MLA layers, a plain object for the others)."""
    from fuzz.targets import consumers

    backends = consumers.layer_backends(walk)
    layers = consumers.forward_context(walk, mla_layer, backends)
    sharing = dict(walk.case.kv_sharing)

    def metadata(name: str) -> Any:
        owner = sharing.get(name, name)
        if walk.case.groups[walk.case.group_of(owner)].spec.kind in MLA_KINDS:
            return mla_metadata(module, name, backends.get(owner))
        return types.SimpleNamespace()

    return types.SimpleNamespace(no_compile_layers=layers, attn_metadata={name: metadata(name) for name in layers})


def request(module: types.ModuleType, walk: Any, blocks: list[int], is_store: bool) -> Any:
    """The connector's metadata for one request of the blocks' tokens (and one more: the token to decode, which the
    connector leaves out), through its own class."""
    block_size = nixl.tokens_per_block(walk)
    metadata = module.ExampleConnectorMetadata()
    metadata.add_request(token_ids=list(range(1, len(blocks) * block_size + 2)), block_ids=list(blocks), block_size=block_size,
                         is_store=is_store, mm_hashes=[])
    return metadata


def connector(cls: type, module: types.ModuleType, walk: Any) -> Any:
    return cls(walk.vllm_config, module.KVConnectorRole.WORKER, connector_config(walk))


def save(cls: type, module: types.ModuleType, walk: Any, blocks: list[int], mla_layer: type | None, folder: str) -> list[str]:
    """The sender's forward: each layer hands its cache to save_kv_layer, the request's blocks to store."""
    with stand_ins(walk, folder) as replaced:
        sender = connector(cls, module, walk)
        sender.bind_connector_metadata(request(module, walk, blocks, is_store=True))
        context = forward_context(module, walk, mla_layer)
        for name, layer in context.no_compile_layers.items():
            sender.save_kv_layer(name, layer.kv_cache, context.attn_metadata[name])
        sender.wait_for_save()
    return replaced


def load(cls: type, module: types.ModuleType, walk: Any, blocks: list[int], mla_layer: type | None, folder: str) -> None:
    """The receiver's step: start_load_kv injects the saved tokens into the request's blocks."""
    with stand_ins(walk, folder):
        receiver = connector(cls, module, walk)
        receiver.bind_connector_metadata(request(module, walk, blocks, is_store=False))
        receiver.start_load_kv(forward_context(module, walk, mla_layer))


def second_copy(walk: Any) -> Any:
    """The case walked again on buffers of its own."""
    try:
        return walk.walk_of(walk.case)
    except (Inexpressible, CaseMismatch, BrokenDeclaration) as error:
        raise Unusable(f"the case's second copy does not build here ({type(error).__name__}: {error})".splitlines()[0]) from error


def play(cls: type, walk: Any, mla_layer: type | None) -> Record:
    """The case's blocks saved from the walk's caches and loaded into other blocks of a second copy; the record compares
    the two as a played transfer's (`nixl.compare_ends`)."""
    module = importlib.import_module(cls.__module__)
    sent = sent_blocks(walk.case)
    peer = second_copy(walk)
    received = receiving_blocks(peer.case.num_blocks, sent)
    sender, receiver = End(walk), End(peer)
    nixl.fill(walk, 1)
    nixl.fill(peer, 2)
    before = [raw.clone() for raw in peer.raw]
    with tempfile.TemporaryDirectory(prefix="kvfuzz-example-") as folder:
        replaced = save(cls, module, walk, sent, mla_layer, folder)
        load(cls, module, peer, received, mla_layer, folder)
    record: Record = {"replaced": replaced, "refused": [], "sent": sent, "received": received, "failed": [], "finished": True,
                      "receiver_buffers": len(peer.raw)}
    return {**record, **nixl.compare_ends(sender, receiver, sent, received, before)}


class ExampleConnectorCheck(TouchCheck):
    """ExampleConnector's save and load, played (see the module's doc)."""

    name = "example-connector"
    drawn = True
    setting = "--kv-transfer-config '{\"kv_connector\": \"ExampleConnector\", \"kv_role\": \"kv_both\"}'"
    reads_buffers = False  # it fills both copies itself
    kinds = {kind: nixl.NixlCheck.kinds[kind] for kind in ("transfer-wrong", "transfer-stray")}

    def offer(self, probe: Any) -> Run | Off | None:
        cls = connector_class()
        if cls is None:
            return None
        if probe.find("allocation") is None:
            return Off(f"{MODULE}: kvfuzz plays its save and load on the per-layer [B, H, N, C] caches of 0.29+ "
                       "(allocate_kv_cache); before, it indexed each backend's own cache shape and loaded with .cuda()")
        from fuzz.targets import consumers  # torch and vLLM: the worker's, never the coordinator's

        mla_layer = consumers.mla_layer_class(probe)
        where = f"{cls.__module__}.{cls.__name__}.start_load_kv"

        def run(walk: Any, touches: Any) -> Record:
            reason = self.unrealistic(walk.case)
            if reason is not None:
                raise Unusable(reason)
            if len(walk.config.kv_cache_groups) != 1:
                raise Unusable(f"{ONE_GROUP_RULE}; vLLM planned {len(walk.config.kv_cache_groups)} for this case")
            refuses_connectors(walk)
            if any(group.spec.compress_ratio > 1 for group in walk.case.groups):
                raise Unusable("compressed caches hold one state per several tokens; kvfuzz compares a played transfer token by token")
            return play(cls, walk, mla_layer)

        return consumers.consumer_run("transfer", where, consumers.runners_calling(r"\bregister_kv_caches\("), run)

    def unrealistic(self, case: Case) -> str | None:
        kinds = {group.spec.kind for group in case.groups}
        if not kinds or not kinds <= set(nixl.TRANSFER_KINDS):
            others = sorted(kinds - set(nixl.TRANSFER_KINDS)) or "a model without groups"
            return f"kvfuzz plays ExampleConnector on attention layers only, not {others}"
        if len(case.groups) > 1:
            return ONE_GROUP_RULE
        return None

    def judge(self, judging: Judging, record: Record) -> Finding | None:
        if "skipped" in record or judging.expected is None:
            return None
        function = record["where"].rsplit(".", 1)[-1]
        if "error" in record:
            error = record["error"]
            kind = "refused-valid" if error["type"] in nixl.REFUSALS else "crash-on-valid"
            return observed(judging.case, kind, error.get("function") or function, f"{record['where']}: {error['type']}: {error['message']}")
        return nixl.judge_played(judging, with_receiving_tiles(judging, record), function)


def with_receiving_tiles(judging: Judging, record: Record) -> Record:
    """The record with the bytes the receiving blocks own (their padding included) allowed to change, worked out from the
    judged case, which the receiver is a copy of (where its one buffer is the oracle's one); nixl's own `received_tiles`,
    which reads the receiver's case back from the record, is left out."""
    expected = judging.expected
    assert expected is not None
    one_buffer = record["receiver_buffers"] == 1 and len(expected.buffers) == 1
    tiles = transfer.received_tiles(judging.case, expected, record["received"]) if one_buffer else []
    return {**record, "allowed": record["allowed"] + tiles, "receiver_buffers": 0}


CHECK = ExampleConnectorCheck()
