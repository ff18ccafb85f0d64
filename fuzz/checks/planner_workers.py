"""planner-workers: vLLM's engine-level planner, which plans the KV cache of all workers of one model together.

What runs is vLLM's: `get_kv_cache_configs` (vllm/v1/core/kv_cache_utils.py up to 0.32, kv_cache_planning.py from 0.33,
where it takes the whole model's groups from `get_global_kv_cache_groups`), on the layer specs the walk's plan holds
(vLLM's own spec objects; KV-sharing layers left out, they plan nothing, and encoder-only ones, which the model runner
adds after the engine's plan), and on 0.34 `shrink_kv_cache_configs`. It plans, the block-count override unset, from
a memory of many blocks of the case's bytes per block (planner_fit's `memory_for`: exactly the blocks for an even count,
one byte short for an odd one), each worker's count drawn from the case's hash:

- the whole model on one worker: the reference, whose groups are the whole model's grouping and whose tensors give each
  tensor's bytes per block. How vLLM groups a model is not judged here: a model it refuses to group (DeepSeek V4's
  grouping asserts MLA layers beside its sliding-window MLA ones, say) is skipped, with nothing to hold workers against;
- tensor-parallel ranks: the same specs on 2 - 4 workers with different memories, then (0.34) shrunk by a few blocks.
  Each rank must plan the reference's groups and tensor layers, the least blocks any rank's memory holds, and tensors of
  that many blocks of their bytes per block;
- pipeline stages: the case's layers cut in 2 - 3 contiguous stages, each worker given only its stage's specs. Each
  stage must plan the reference's groups projected on its layers (oracles/contract.py `projected_layers`: a group with
  none of its layers there is kept, empty), tensors backing exactly its own layers, and one block count for all
  stages: the least any stage's memory holds at the bytes per block its plan spends;
- the hybrid KV-cache manager off (`scheduler_config.disable_hybrid_kv_cache_manager`): one worker of every layer, which
  must be planned as one type in one group, or refused, as oracles/planner.py `unified` says (where it says nothing, the
  record is kept and not judged).

What is stood in is outside that code: the workers themselves (their spec dicts and memories are handed over in one
process: no executor, no process group, no memory profiling) and the model's description, of which the planner reads
only the context length and (0.34) whether the model groups its layers itself (the walk's config has no model). A refusal
in any of the workers' plans is a finding unless the oracle says the planner must refuse.

A case asks for the check by naming it in `touches.consumers`; it is not drawn into campaigns yet.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import random
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fuzz.case import Case, replace
from fuzz.checks import nixl
from fuzz.checks.nixl import StandInGap
from fuzz.checks.planner_fit import backing_bytes, memory_for
from fuzz.checks.protocol import Judging, Off, Record, Run, TouchCheck, Unusable
from fuzz.tracebacks import vllm_failure
from fuzz.verdict.findings import Finding, observed
from oracles import planner

if TYPE_CHECKING:
    from fuzz.targets.entry_points import Probe
    from fuzz.targets.walk import Walk

ENGINE_PLANNER = "get_kv_cache_configs"
SHRINK = "shrink_kv_cache_configs"
UNIFY = "unify_hybrid_kv_cache_specs"
PLANNER_MODULES = ("vllm.v1.core.kv_cache_planning", "vllm.v1.core.kv_cache_utils")
# Blocks each worker's memory holds, about: many more than one request of MAX_MODEL_LEN tokens needs in any layer (the
# planner refuses memory that cannot serve one), so no plan here meets that refusal. Plans are numbers, never allocated.
BASE_BLOCKS = 1 << 20
MAX_MODEL_LEN = 2048
TP_SIZES = (2, 4)
STAGE_COUNTS = (2, 3)
MEMORY_SPREAD = 8  # each worker's memory holds BASE_BLOCKS + 0 .. MEMORY_SPREAD - 1 blocks, distinct among workers
# vLLM's spec classes by the case's kind (fuzz/targets/catalog.py SPEC_CLASSES); a class is read as its nearest listed base.
SPEC_KINDS = {"FullAttentionSpec": "full", "SlidingWindowSpec": "sliding_window", "ChunkedLocalAttentionSpec": "chunked_local",
              "SinkFullAttentionSpec": "sink", "CrossAttentionSpec": "cross", "EncoderOnlyAttentionSpec": "encoder_only",
              "MLAAttentionSpec": "mla", "SlidingWindowMLASpec": "sliding_window_mla", "MambaSpec": "mamba"}


@dataclass(frozen=True)
class EnginePlanner:
    """vLLM's engine-level planner as this release has it: the call, the global grouping it takes from 0.33 (None before),
    and the shrink after warmup (0.34; None before)."""

    plan_all: Callable[..., Any]
    global_groups: Callable[..., Any] | None
    shrink: Callable[..., Any] | None

    def plan(self, config: Any, specs: list[dict[str, Any]], memories: list[int]) -> list[Any]:
        if self.global_groups is None:
            return self.plan_all(config, specs, memories)
        return self.plan_all(config, specs, memories, self.global_groups(config, specs))


@dataclass(frozen=True)
class Draw:
    """The case's workers, drawn from its hash: the TP ranks' block counts, the stages' first layers and block counts, and
    how many blocks a shrink takes off."""

    tp_blocks: tuple[int, ...]
    stage_starts: tuple[int, ...]
    stage_blocks: tuple[int, ...]
    shrink_by: int

    @classmethod
    def of(cls, case: Case, layer_count: int) -> Draw:
        rng = random.Random(int(planner_key(case).content_hash(), 16))
        tp_size = rng.randint(*TP_SIZES)
        stages = min(rng.randint(*STAGE_COUNTS), layer_count)
        starts = (0, *sorted(rng.sample(range(1, layer_count), stages - 1))) if stages > 1 else (0,)
        return cls(blocks(rng, tp_size), starts, blocks(rng, stages), rng.randint(1, 4))


def blocks(rng: random.Random, workers: int) -> tuple[int, ...]:
    return tuple(BASE_BLOCKS + offset for offset in rng.sample(range(MEMORY_SPREAD), workers))


def planner_key(case: Case) -> Case:
    """The facts the planner reads: specs, layers, packing, platform and layout; not the runners, consumers or writes."""
    return replace(case, touches=None, device=None, runner="v2")


class ModelStandIn:
    """The model's description, of which the engine-level planner reads the context length (set: no auto-fit) and, from
    0.34, whether the model groups its layers itself (SupportsKVCacheGrouping; kvfuzz's layers are grouped by vLLM)."""

    def __init__(self) -> None:
        self.max_model_len = MAX_MODEL_LEN
        self.original_max_model_len = MAX_MODEL_LEN
        self.supports_kv_cache_grouping = False

    def __getattr__(self, name: str) -> Any:
        raise StandInGap(f"the engine-level planner asks the model config for {name}, which kvfuzz's stand-in does not state")


STOOD_IN = ["the workers: their spec dicts and memories handed to the planner in one process (no executor, process group or "
            "memory profiling)", f"the model config: a stand-in stating max_model_len {MAX_MODEL_LEN} and no grouping of the model's own"]


class PlannerWorkers(TouchCheck):
    name = "planner-workers"
    drawn = True
    reads_buffers = False
    kinds = {  # noqa: RUF012 - read only
        "workers-differ": ("Workers of one model were planned other KV-cache groups or tensor layers than the whole model's "
                           "grouping gives them (TP ranks alike, pipeline stages its projection on their layers), or block "
                           "counts that differ."),
        "workers-blocks": ("Workers of one model were planned another block count than the least any worker's memory holds, "
                           "or tensors of other sizes than that many blocks of their bytes per block (also after a shrink)."),
        "workers-layers": "A pipeline stage's KV-cache tensors back layers of another stage, or not each of its own layers once.",
        "unified-groups": ("With the hybrid KV-cache manager off, the plan is not one group of every layer planned as one "
                           "type, sliding-window and chunked-local layers as full attention."),
        "planner-workers": ("vLLM's engine-level planner refused workers' specs it must plan, or planned a hybrid model the "
                            "hybrid-off planner must refuse."),
    }

    def offer(self, probe: Probe) -> Run | Off | None:
        found = probe.find("planner")
        if found is None:
            return None
        module = next((m for m in planner_modules(found.module) if hasattr(m, ENGINE_PLANNER)), None)
        if module is None:
            return None
        plan_all = getattr(module, ENGINE_PLANNER)
        parameters = list(inspect.signature(inspect.unwrap(plan_all)).parameters)
        if parameters[:3] != ["vllm_config", "kv_cache_specs", "available_memory"] or len(parameters) > 4:
            return Off(f"{ENGINE_PLANNER} takes ({', '.join(parameters)}); kvfuzz knows how to call it with the config, the "
                       "specs and the memories, and the whole model's groups")
        global_groups = None
        if len(parameters) == 4:
            global_groups = getattr(module, "get_global_kv_cache_groups", None)
            if parameters[3] != "global_kv_cache_groups" or global_groups is None:
                return Off(f"{ENGINE_PLANNER} takes {parameters[3]}, and kvfuzz finds no get_global_kv_cache_groups to give it")
        return functools.partial(run, EnginePlanner(plan_all, global_groups, getattr(module, SHRINK, None)))

    def applies(self, case: Case) -> bool:
        return bool(case.groups) and super().applies(case)

    def key(self, case: Case) -> Hashable:
        return planner_key(case)

    def judge(self, judging: Judging, record: Record) -> Finding | None:
        if "skipped" in record:
            return None
        case, whole = judging.case, record["whole"]
        for judged in (judge_tp(case, whole, record["tp"]), judge_stages(case, whole, record["stages"]),
                       judge_unified(case, record["unified"])):
            if judged is not None:
                return judged
        return None


def planner_modules(home: str) -> Iterator[Any]:
    """The planner's module, then where releases kept the engine-level planner."""
    for name in dict.fromkeys((home, *PLANNER_MODULES)):
        try:
            yield importlib.import_module(name)
        except ImportError:
            continue


# ------------------------------------------------------------------------------------------- the run


def run(engine: EnginePlanner, walk: Walk) -> Record:
    specs = layer_specs(walk)
    if not specs:
        raise Unusable("no layer of the case plans a KV cache of its own")
    draw = Draw.of(walk.case, len(specs))
    config = walk.vllm_config
    with planning(config):
        whole, _ = planned(engine, config, [specs], [memory_for(BASE_BLOCKS, case_bytes_per_block(walk))])
        if "error" in whole:
            raise Unusable(f"one worker of every layer is refused ({whole['error']}): no whole-model plan to hold workers against")
        if not whole["configs"][0]["groups"]:
            raise Unusable("the planner plans no KV cache for this model")
        per_block = bytes_per_block(whole["configs"][0])
        if per_block is None:
            raise Unusable("the whole model's plan spends no whole number of bytes per block")
        tp, configs = planned(engine, config, [dict(specs) for _ in draw.tp_blocks], [memory_for(n, per_block) for n in draw.tp_blocks])
        if engine.shrink is not None and configs is not None:
            tp["shrunk"] = shrunk(engine, config, configs, draw.shrink_by)
        stages = stage_specs(specs, draw.stage_starts)
        staged = {"skipped": "one layer: no stages to cut"}
        if len(stages) > 1:
            staged, _ = planned(engine, config, stages, [memory_for(n, per_block) for n in draw.stage_blocks])
            staged["layers"] = [list(stage) for stage in stages]
        with nixl._attribute(config.scheduler_config, "disable_hybrid_kv_cache_manager", True):
            unified, _ = planned(engine, config, [dict(specs)], [memory_for(BASE_BLOCKS, per_block)])
    return {"stood_in": STOOD_IN, "whole": whole, "tp": tp, "stages": staged, "unified": unified}


def layer_specs(walk: Walk) -> dict[str, Any]:
    """vLLM's spec of each layer the engine plans, in the case's order, as the walk's plan holds them: not KV-sharing
    layers (they plan nothing of their own), nor encoder-only ones (the model runner adds them to the engine's plan,
    GPUModelRunner.may_add_encoder_only_layers_to_kv_cache_config)."""
    unplanned = set(dict(walk.case.kv_sharing))
    unplanned.update(name for group in walk.case.groups if group.spec.kind == "encoder_only" for name in group.layers)
    specs: dict[str, Any] = {}
    for group in walk.config.kv_cache_groups:
        per_layer = getattr(group.kv_cache_spec, "kv_cache_specs", None)
        for name in group.layer_names:
            if name not in unplanned:
                specs[name] = per_layer[name] if per_layer is not None else group.kv_cache_spec
    return specs


def case_bytes_per_block(walk: Walk) -> int:
    """The bytes per block the walk's plan of the case spends (planner_fit's measure), at least one."""
    return max(backing_bytes(walk.config.kv_cache_tensors) // max(walk.case.num_blocks, 1), 1)


def stage_specs(specs: dict[str, Any], starts: Sequence[int]) -> list[dict[str, Any]]:
    """The layers' specs cut into contiguous stages, each from its first layer's position."""
    names = list(specs)
    ends = (*starts[1:], len(names))
    return [{name: specs[name] for name in names[start:end]} for start, end in zip(starts, ends, strict=True)]


@contextlib.contextmanager
def planning(config: Any) -> Iterator[None]:
    """The walk's config as the engine plans from memory: no block-count override, and a model that states its length."""
    with nixl._attribute(config.cache_config, "num_gpu_blocks_override", None), nixl._attribute(config, "model_config", ModelStandIn()):
        yield


def planned(engine: EnginePlanner, config: Any, specs: list[dict[str, Any]], memories: list[int]) -> tuple[Record, list[Any] | None]:
    """The workers' memories and their plans, summarized (and vLLM's own), or the planner's refusal."""
    try:
        configs = engine.plan(config, specs, memories)
    except Unusable:
        raise
    except Exception as error:  # noqa: BLE001 - judged: the planner refusing what it was given
        return {"memory": memories, **refusal(error)}, None
    return {"memory": memories, "configs": [summary(c) for c in configs]}, configs


def shrunk(engine: EnginePlanner, config: Any, configs: list[Any], by: int) -> Record:
    """The ranks' plans shrunk in place by `by` blocks, summarized, or the shrink's refusal."""
    blocks = int(configs[0].num_blocks) - by
    assert engine.shrink is not None
    try:
        engine.shrink(config, configs, blocks)
    except Unusable:
        raise
    except Exception as error:  # noqa: BLE001 - judged: the shrink refusing what it was given
        return {"blocks": blocks, **refusal(error)}
    return {"blocks": blocks, "configs": [summary(c) for c in configs]}


def refusal(error: Exception) -> Record:
    """vLLM's error as the record keeps it; kvfuzz's own propagate."""
    failure = vllm_failure(error)
    if failure is None:
        raise error
    return {"error": f"{failure.error_type}: {failure.error_message}", "function": failure.error_function}


def summary(config: Any) -> Record:
    """A worker's KVCacheConfig as plain data: block count, backing bytes, groups and tensors."""
    return {"num_blocks": int(config.num_blocks), "backing_bytes": backing_bytes(config.kv_cache_tensors),
            "groups": [group_summary(group) for group in config.kv_cache_groups],
            "tensors": [{"layers": tensor_layers(tensor), "size": int(tensor.size)} for tensor in config.kv_cache_tensors]}


def group_summary(group: Any) -> Record:
    spec = group.kv_cache_spec
    per_layer = getattr(spec, "kv_cache_specs", None)
    specs = [spec if per_layer is None else per_layer.get(name) for name in group.layer_names]
    return {"layers": list(group.layer_names), "block_size": int(spec.block_size), "kind": kind_of(spec),
            "kinds": [None if s is None else kind_of(s) for s in specs],
            "pages": [None if s is None else int(s.page_size_bytes) for s in specs]}


def kind_of(spec: Any) -> str:
    """The case's kind of a vLLM spec ("uniform_type" for a group of per-layer specs)."""
    if hasattr(spec, "kv_cache_specs"):
        return "uniform_type"
    return next((SPEC_KINDS[c.__name__] for c in type(spec).__mro__ if c.__name__ in SPEC_KINDS), type(spec).__name__)


def tensor_layers(tensor: Any) -> list[str]:
    layers = getattr(tensor, "layers", None)
    return list(layers if layers is not None else tensor.shared_by)


def bytes_per_block(config: Record) -> int | None:
    """The bytes a worker's plan spends per block (its backing bytes over its blocks), None if no whole number."""
    blocks, total = config["num_blocks"], config["backing_bytes"]
    return total // blocks if blocks > 0 and total % blocks == 0 else None


# ------------------------------------------------------------------------------------------- the judgement


def judge_tp(case: Case, whole: Record, tp: Record) -> Finding | None:
    """TP ranks: the whole model's groups and tensor layers each, the least blocks any rank's memory holds, tensors of that
    many blocks of the whole model's bytes per block; after a shrink, the blocks asked for."""
    if "error" in tp:
        return refused(case, f"{ENGINE_PLANNER} refused {len(tp['memory'])} TP ranks of the model one worker plans", tp)
    reference = whole["configs"][0]
    per_block = [bytes_per_block(reference) or 1] * len(tp["memory"])  # whole (the run skips a plan of no whole bytes)
    blocks = planner.least_blocks(tp["memory"], per_block)
    ranks = len(tp["configs"])
    for rank, config in enumerate(tp["configs"]):
        where = f"TP rank {rank} of {ranks}"
        held = f"{where}, of memories holding {fits(tp['memory'], per_block)} blocks,"
        found = differs(case, where, reference, config) or wrong_blocks(case, ENGINE_PLANNER, held, reference, config, blocks)
        if found is not None:
            return found
    shrunk = tp.get("shrunk")
    if shrunk is None:
        return None
    if "error" in shrunk:
        return refused(case, f"{SHRINK} refused to shrink {ranks} TP ranks to {shrunk['blocks']} blocks", shrunk)
    for rank, config in enumerate(shrunk["configs"]):
        found = wrong_blocks(case, SHRINK, f"TP rank {rank} of {ranks} shrunk", reference, config, planner.shrunk(shrunk["blocks"]))
        if found is not None:
            return found
    return None


def differs(case: Case, where: str, reference: Record, config: Record) -> Finding | None:
    """A worker of the whole model's layers planned other groups or tensor layers than one worker of them is."""
    difference = group_difference([planner.Group.of(g) for g in config["groups"]], [planner.Group.of(g) for g in reference["groups"]])
    if difference is None and tensor_sets(config) != tensor_sets(reference):
        difference = f"tensors backing {tensor_sets(config)} instead of {tensor_sets(reference)}"
    if difference is None:
        return None
    return observed(case, "workers-differ", ENGINE_PLANNER, f"{where} is planned otherwise than one worker of the model: {difference}")


def wrong_blocks(case: Case, function: str, where: str, reference: Record, config: Record, blocks: int) -> Finding | None:
    """A worker's plan of the reference's tensors with another block count than `blocks`, or tensors of other sizes than
    that many blocks of the reference's bytes per block (tensors matched by their layers)."""
    if config["num_blocks"] != blocks:
        return observed(case, "workers-blocks", function, f"{where} is planned {config['num_blocks']} blocks instead of {blocks}")
    sizes = {tuple(sorted(t["layers"])): t["size"] for t in reference["tensors"]}
    for tensor in config["tensors"]:
        size = sizes.get(tuple(sorted(tensor["layers"])))
        if size is not None and tensor["size"] * reference["num_blocks"] != size * blocks:
            return observed(case, "workers-blocks", function, f"{where} has a tensor of {tensor['size']} bytes for {blocks} blocks "
                                                              f"of {size} bytes per {reference['num_blocks']} blocks")
    return None


def judge_stages(case: Case, whole: Record, stages: Record) -> Finding | None:
    """Pipeline stages: tensors backing exactly each stage's layers, the whole model's groups projected on them, and one
    block count, the least any stage's memory holds at the bytes per block its plan spends."""
    if "skipped" in stages:
        return None
    count = len(stages["memory"])
    if "error" in stages:
        return refused(case, f"{ENGINE_PLANNER} refused the model cut in {count} pipeline stages", stages)
    groups = [planner.Group.of(g) for g in whole["configs"][0]["groups"]]
    configs = stages["configs"]
    for index, (layers, config) in enumerate(zip(stages["layers"], configs, strict=True)):
        foreign, missing, twice = planner.stray_layers([t["layers"] for t in config["tensors"]], layers)
        if foreign or missing or twice:
            what = "back layers of other stages" if foreign else ("leave some of its layers out" if missing else
                                                                 "back some of its layers twice")
            return observed(case, "workers-layers", ENGINE_PLANNER, f"stage {index} of {count}: its KV-cache tensors {what}",
                            (foreign or missing or twice)[0])
    for index, (layers, config) in enumerate(zip(stages["layers"], configs, strict=True)):
        difference = group_difference([planner.Group.of(g) for g in config["groups"]], planner.projected(groups, layers))
        if difference is not None:
            return observed(case, "workers-differ", ENGINE_PLANNER, f"stage {index} of {count} is planned otherwise than the whole "
                                                                    f"model's groups projected on its layers: {difference}")
    return stage_blocks(case, stages)


def stage_blocks(case: Case, stages: Record) -> Finding | None:
    configs, count = stages["configs"], len(stages["memory"])
    planned_blocks = [config["num_blocks"] for config in configs]
    if len(set(planned_blocks)) > 1:
        return observed(case, "workers-differ", ENGINE_PLANNER, f"{count} pipeline stages are planned {planned_blocks} blocks")
    per_block = [bytes_per_block(config) for config in configs]
    if None in per_block:
        stage = per_block.index(None)
        return observed(case, "workers-blocks", ENGINE_PLANNER, f"stage {stage} of {count}: {configs[stage]['backing_bytes']} bytes "
                                                                f"of tensors are no whole number of its {planned_blocks[0]} blocks")
    own_bytes = [size or 1 for size in per_block]  # none is None here
    blocks = planner.least_blocks(stages["memory"], own_bytes)
    if planned_blocks[0] != blocks:
        held = fits(stages["memory"], own_bytes)
        return observed(case, "workers-blocks", ENGINE_PLANNER, f"{count} pipeline stages, of memories holding {held} blocks, are "
                                                                f"planned {planned_blocks[0]} blocks each instead of {blocks}")
    return None


def judge_unified(case: Case, unified: Record) -> Finding | None:
    """The hybrid KV-cache manager off: one group of every layer planned as the oracle's kind, or a refusal where it says."""
    expected = planner.unified(case)
    if expected is None:
        return None
    if expected.kind is None:
        if "error" in unified and unified["error"].startswith("ValueError"):
            return None
        got = unified.get("error") or f"{len(unified['configs'][0]['groups'])} groups"
        return observed(case, "planner-workers", UNIFY, f"with the hybrid KV-cache manager off, {expected.why}, and the "
                                                        f"planner gave {got} instead of refusing them")
    if "error" in unified:
        return refused(case, f"with the hybrid KV-cache manager off, {expected.why}, and {ENGINE_PLANNER} refused them", unified)
    config = unified["configs"][0]
    layers = [name for layers in (t["layers"] for t in config["tensors"]) for name in layers]
    groups = [planner.Group.of(g) for g in config["groups"]]
    wrong = None
    if len(groups) != 1:
        wrong = f"{len(groups)} groups instead of one"
    elif any(kind != expected.kind for kind in groups[0].kinds):
        wrong = f"layers planned as {sorted(set(map(str, groups[0].kinds)))} instead of {expected.kind} attention"
    elif any(planner.stray_layers([layers], groups[0].layers)):
        wrong = "tensors that do not back each layer of the group once"
    if wrong is None:
        return None
    return observed(case, "unified-groups", UNIFY, f"with the hybrid KV-cache manager off, {expected.why}, and the planner "
                                                   f"gave {wrong}")


def group_difference(got: list[planner.Group], expected: list[planner.Group]) -> str | None:
    if len(got) != len(expected):
        return f"{len(got)} groups instead of {len(expected)}"
    for index, (mine, theirs) in enumerate(zip(got, expected, strict=True)):
        if mine != theirs:
            return f"group {index} is {mine} instead of {theirs}"
    return None


def tensor_sets(config: Record) -> list[list[str]]:
    return sorted(sorted(tensor["layers"]) for tensor in config["tensors"])


def fits(memories: Sequence[int], per_block: Sequence[int]) -> list[int]:
    """The blocks each worker's memory holds at its bytes per block."""
    return [planner.fitted(memory, size)[0] for memory, size in zip(memories, per_block, strict=True)]


def refused(case: Case, what: str, record: Record) -> Finding:
    return observed(case, "planner-workers", record.get("function") or ENGINE_PLANNER, f"{what}: {record['error']}")


CHECK = PlannerWorkers()
