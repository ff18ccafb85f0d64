"""The model runners' walk of a case, as the adapter runs it: specs, the plan, KV-sharing layers, kernel block sizes, the
call under test on real buffers, the views recorded as plain data, and the deeper checks (fuzz/checks) on the walk.

Everything per case lives in the objects a walk returns (Prepared, Made, fuzz/targets/walk.py's Walk), never on the
long-lived adapter.
"""

from __future__ import annotations

import contextlib
import dataclasses
import typing
from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch

import oracles
from fuzz.case import Case, GroupCase, replace
from fuzz.checks.protocol import Check, Record, Unusable
from fuzz.checks.registry import CHECKS
from fuzz.checks.timing import timed
from fuzz.errors import BrokenDeclaration, CaseMismatch, Inexpressible
from fuzz.space import accepts
from fuzz.targets.base import BufferRecord, Execution, Outcome, ViewRecord, probe_kind
from fuzz.targets.catalog import DTYPE_NAMES, kernel_size_label
from fuzz.targets.entry_points import Probe
from fuzz.targets.probe import physical_probe, storage_key
from fuzz.targets.runner_v1 import V1Runner
from fuzz.targets.spec_builder import LayerSpecs
from fuzz.targets.unfilled import unfilled_buffers
from fuzz.targets.walk import Walk
from fuzz.tracebacks import capture, vllm_failure
from oracles import kernel_choice

# Plenty for any case kvfuzz draws; the block count itself comes from the override.
AVAILABLE_MEMORY = 1 << 40


class Made(typing.NamedTuple):
    """What the call under test made: the views each layer binds, the raw buffers (in config order), and where the runner
    keeps other views than the layers bind (kernel-block views from 0.32), those it keeps and connectors get."""

    views: dict[str, Any]
    raw: list[torch.Tensor]
    manager_views: dict[str, Any] | None = None


@dataclasses.dataclass
class Prepared:
    """A case walked up to the call under test, as the model runners' initialize_kv_cache prepares it: the planned
    config (KV-sharing layers in their target's group), the attention groups and each group's kernel block size."""

    config: Any
    attn_groups: list[list[Any]]
    kernel_block_sizes: list[int]
    used: dict[int, int]  # kernel block size per group, as vLLM derives it for the views it binds
    views: Callable[[], Made]  # the V2 runner's call under test
    replan: Callable[[int], Any]  # the groups planned again from a memory, the block-count override unset
    # Groups whose kernel block size vLLM picked against its own rule: index -> [vLLM's size, the rule's].
    kernel_rule: dict[int, list[int]] = dataclasses.field(default_factory=dict)


def check_derived_kernel_sizes(case: Case, used: dict[int, int],
                               declared: Callable[[int], tuple[int | str, ...] | None]) -> dict[int, list[int]]:
    """A case states each group's kernel block size: the one the contract's rule picks from what the backend declares
    (oracles/contract.py `kernel_block_size`); vLLM derives its own. Where they differ:
    - vLLM's size breaks the backend's declaration or does not divide the block: vLLM's choice gone wrong, and the views it
      builds are judged against the case's size;
    - vLLM's size is another declared size that divides the block, and the case's is the rule's: vLLM broke its own rule.
      Returned (group index -> [vLLM's size, the rule's]): a finding of its own, and the views are judged at vLLM's size;
    - otherwise the case states a size the rule does not pick (or the backend cannot say): the case is wrong
      (CaseMismatch names the field and both values), not vLLM."""
    broken: dict[int, list[int]] = {}
    for index, group in enumerate(case.groups):
        derived = used.get(index)
        stated = group.kernel_block_size or group.spec.block_size
        if derived is None or derived == stated:
            continue
        sizes = declared(index)
        if sizes is not None and (group.spec.block_size % derived or not accepts(sizes, derived)):
            continue
        if sizes is not None and kernel_choice.picked_against_rule(group.spec.block_size, sizes, derived) == stated:
            broken[index] = [derived, stated]
            continue
        raise CaseMismatch(f"groups[{index}].kernel_block_size: the case says {stated}, vLLM derives {derived} "
                           f"for {group.backend_name} and block size {group.spec.block_size}")
    return broken


def at_kernel_sizes(case: Case, sizes: dict[int, list[int]]) -> Case:
    """The case with the kernel block size vLLM picked for each group in `sizes` (group index -> [vLLM's, the rule's])."""
    groups = tuple(replace(group, kernel_block_size=sizes[index][0]) if index in sizes else group for index, group in enumerate(case.groups))
    return replace(case, groups=groups)


def stated_kernel_sizes_declared(case: Case, attn_groups: list[list[Any]]) -> bool:
    """Whether every group whose backend can say declares the case's kernel block size for its spec and the size divides
    the block (at least one group can say)."""
    said = False
    for index, group in enumerate(case.groups):
        sizes = declared_kernel_sizes(attn_groups, index)
        if sizes is None:
            continue
        stated = group.kernel_block_size or group.spec.block_size
        if group.spec.block_size % stated or not accepts(sizes, stated):
            return False
        said = True
    return said


def declared_kernel_sizes(attn_groups: list[list[Any]], index: int) -> tuple[int | str, ...] | None:
    """The kernel block sizes group `index`'s backend declares for its spec (ints, or "xN"); None when it cannot say."""
    if index >= len(attn_groups) or not attn_groups[index]:
        return None
    backend, spec = attn_groups[index][0].backend, attn_groups[index][0].kv_cache_spec
    ask = getattr(backend, "get_supported_kernel_block_sizes", None)
    if ask is None:
        return None
    try:
        sizes = ask(spec)
    except TypeError:  # releases whose backends take no spec
        sizes = ask()
    return tuple(kernel_size_label(size) for size in sizes)


def _inside_buffers(outcome: Outcome) -> bool:
    """Whether every recorded view addresses only bytes of its raw buffer (a consumer run on any other would write wild)."""
    for records in outcome.views.values():
        for view in records:
            if view.buffer < 0:
                return False
            low = high = view.offset_bytes
            for size, stride in zip(view.shape, view.byte_strides, strict=True):
                if size == 0:
                    break
                reach = (size - 1) * stride
                low, high = (low + reach, high) if reach < 0 else (low, high + reach)
            if low < 0 or high + view.element_size > outcome.buffers[view.buffer].size:
                return False
    return True


def record_view(tensor: torch.Tensor, buffers: dict[int, int]) -> ViewRecord:
    return ViewRecord(
        shape=tuple(tensor.shape),
        stride=tuple(tensor.stride()),
        offset_bytes=tensor.storage_offset() * tensor.element_size(),
        dtype=DTYPE_NAMES.get(tensor.dtype, str(tensor.dtype)),
        element_size=tensor.element_size(),
        buffer=buffers.get(storage_key(tensor), -1),
    )


def unique_buffers(tensors: Any) -> list[torch.Tensor]:
    """Distinct raw tensors, in first-seen order."""
    seen: dict[int, torch.Tensor] = {}
    for tensor in tensors:
        seen.setdefault(storage_key(tensor), tensor)
    return list(seen.values())


class Walker:
    """The part of an adapter that walks a case through vLLM and records what it built."""

    config: Any
    probe: Probe
    planner: Any
    group_spec: Any
    sharing: Any
    kernel_choice: Any
    attention_group: Any
    transfer_config: Any
    layer_specs: LayerSpecs | None
    v1: V1Runner | None
    runs: dict[str, Any]
    max_buffer_bytes: int
    off: dict[str, str]

    def checks(self) -> tuple[Check, ...]:
        """The deeper checks this target offers (fuzz/checks), in the order a case meets them."""
        return tuple(check for check in CHECKS if check.name in self.runs)

    def execute(self, case: Case, device: str, probe: bool | str = False, checks: Collection[str] | None = None) -> Execution:
        """The case through vLLM and the deeper checks it asks for (`checks`: only these, by name; None: all it asks for)."""
        translated = self.translate(case)
        if isinstance(translated, str):
            return Execution(case, skipped=translated)
        case = translated
        reason = self.unsupported(case)
        if reason is not None:
            return Execution(case, skipped=reason)
        try:
            declared = self.declare(case)
        except Inexpressible as error:
            return Execution(case, skipped=str(error))
        except BrokenDeclaration as error:
            return Execution(case, declaration=(error.function, str(error), error.layer))
        except Exception as error:  # noqa: BLE001 - building specs or asking the backend failed: judged like any vLLM error
            failure = vllm_failure(error)
            if failure is None:
                raise
            return Execution(case, outcome=failure)
        if device != "meta" and self.max_buffer_bytes and oracles.buffer_bytes(declared, self.info.contract) > self.max_buffer_bytes:  # type: ignore[attr-defined]
            # Alignment rules can blow a few-block case up to GiBs; describe those at production scale instead.
            return Execution(declared, skipped=f"its buffers need more than {self.max_buffer_bytes} bytes")
        wanted = [check for check in self.checks() if (checks is None or check.name in checks)
                  and (check.applies(declared) or (check.probe is not None and check.probe == probe_kind(probe)))]
        runner = "v1" if declared.runner == "v1" else "v2"
        try:
            outcome = self.runner_outcome(declared, torch.device(device), probe, runner, [c for c in wanted if c.needs_views])
        except CaseMismatch as error:
            return Execution(declared, case_error=str(error))
        except Inexpressible as error:
            return Execution(declared, skipped=str(error))
        if outcome.kernel_rule:  # vLLM picked other kernel block sizes than its rule: its views are judged at its own sizes
            declared = at_kernel_sizes(declared, outcome.kernel_rule)
        alone = [check for check in wanted if not check.needs_views]
        if alone:
            walk = Walk.of_case(declared, self.config, lambda other: self.runner_outcome(declared, torch.device(device), probe, other, []))
            outcome = replace(outcome, checks={**outcome.checks, **self.run_checks(alone, walk)})
        return Execution(declared, outcome=outcome)

    def runner_outcome(self, case: Case, device: torch.device, probe: bool | str, runner: str, checks: list[Check]) -> Outcome:
        """One model runner's walk of the declared case: its views (an error in vLLM's code included), what vLLM's specs say
        of their pages, and the records of the checks that run on its views."""
        specs: list[tuple[Any, str | None]] = []  # vLLM's specs (and the layer that built each), before anything else can fail
        outcome = capture(lambda: self._run(case, device, probe, specs, runner, checks))
        if runner == "v1":
            assert self.v1 is not None
            outcome = self.v1.restore(outcome)
        if specs:
            outcome = self._with_spec_facts(outcome, specs)
        return replace(outcome, runner=runner)

    def _run(self, case: Case, device: torch.device, probe: bool | str, specs: list[tuple[Any, str | None]], runner: str,
             checks: list[Check]) -> Outcome:
        with self.platform_answers(case):
            return self._run_walk(case, device, probe, specs, runner, checks)

    @contextlib.contextmanager
    def platform_answers(self, case: Case) -> Iterator[None]:
        """vLLM's code answering platform questions as on the case's platform (only "cuda" where the target offers no other)."""
        yield

    def _run_walk(self, case: Case, device: torch.device, probe: bool | str, specs: list[tuple[Any, str | None]], runner: str,
                  checks: list[Check]) -> Outcome:
        prepared = self.prepare(case, device, specs)
        kind = probe_kind(probe)
        # The checks run on the V2 runner's walk (from 0.29 the V1 runner's views are the same: walk_runners).
        checks = checks if runner == "v2" else []
        # vLLM zero-fills its buffers; only a run that reads a byte it did not write first needs the zeros.
        reads_bytes = kind == "physical" or any(check.reads_buffers for check in checks)
        with contextlib.nullcontext() if reads_bytes else unfilled_buffers():
            if runner == "v1":
                assert self.v1 is not None
                made = Made(*self.v1.views(case, prepared.config, prepared.attn_groups, prepared.kernel_block_sizes,
                                           self.config.cache_config, self.config, device))
            else:
                made = prepared.views()
        outcome = replace(self.record(made.views, made.raw, dict(case.kv_sharing), prepared.used),
                          planned_blocks=int(prepared.config.num_blocks), kernel_rule=prepared.kernel_rule)
        if device.type == "meta":
            return outcome
        if kind == "physical":
            outcome = replace(outcome, probe=physical_probe(made.views, made.raw))
        if checks:
            if not _inside_buffers(outcome):
                return replace(outcome, checks={c.name: {"skipped": "a view addresses bytes outside its raw buffer"} for c in checks})
            walk = Walk(case=case, config=prepared.config, attn_groups=prepared.attn_groups, kernel_block_sizes=prepared.kernel_block_sizes,
                        manager_views=made.manager_views if made.manager_views is not None else made.views, bound_views=made.views,
                        raw=made.raw, runners=self.walk_runners(), vllm_config=self.config, replan=prepared.replan,
                        walk_of=lambda other: self.peer_walk(other, device.type, case))
            outcome = replace(outcome, checks=self.run_checks(checks, walk))
        return outcome

    def run_checks(self, checks: list[Check], walk: Walk) -> dict[str, Record]:
        """Each check's record on the walk, run as the runner's own code runs (under the model's config) and timed as its own.
        An exception raised in vLLM's code outside what the check's run catches itself is recorded as `raised` (judged
        the same for every check, fuzz/verdict/runner.py); kvfuzz's own propagate."""
        records: dict[str, Record] = {}
        with self.probe.get("set_current_vllm_config")(self.config):
            for check in checks:
                with timed(check.name):
                    try:
                        records[check.name] = self.runs[check.name](walk)
                    except (Unusable, Inexpressible) as why:  # the check, or the other runner, cannot run the case here
                        records[check.name] = {"skipped": str(why)}
                    except Exception as error:  # noqa: BLE001 - judged by the check; kvfuzz's own errors propagate
                        failure = vllm_failure(error)
                        if failure is None:
                            raise
                        records[check.name] = {"raised": {"type": failure.error_type, "message": failure.error_message,
                                                          "function": failure.error_function, "file": failure.error_file,
                                                          "line": failure.error_line}}
        return records

    def peer_walk(self, case: Case, device: str, walking: Case) -> Walk:
        """`case` walked beside the walk of `walking` (the other end of a transfer), the shared config left as `walking`'s
        walk set it (the block-count override, the layout) for the checks that run after."""
        try:
            return self.walk(case, device)
        finally:
            self.config.cache_config.num_gpu_blocks_override = walking.num_blocks
            self.configure_layout(walking.layout)

    def walk(self, case: Case, device: str = "cpu") -> Walk:
        """The V2 runner's walk of a case, views built, for a check run by hand (tests, exports); raises Inexpressible
        where the target cannot run the case."""
        translated = self.translate(case)
        if isinstance(translated, str) or (reason := self.unsupported(translated)) is not None:
            raise Inexpressible(translated if isinstance(translated, str) else reason)
        declared = self.declare(translated)
        with self.platform_answers(declared):
            prepared = self.prepare(declared, torch.device(device))
            made = prepared.views()
        return Walk(case=declared, config=prepared.config, attn_groups=prepared.attn_groups, kernel_block_sizes=prepared.kernel_block_sizes,
                    manager_views=made.manager_views if made.manager_views is not None else made.views, bound_views=made.views,
                    raw=made.raw, runners=self.walk_runners(), vllm_config=self.config, replan=prepared.replan,
                    walk_of=lambda other: self.peer_walk(other, device, declared))

    def walk_runners(self) -> tuple[str, ...]:
        """The model runners whose own initialisation builds this adapter's views (fuzz/targets/consumers.py)."""
        return ("v2",)

    def prepare(self, case: Case, device: torch.device, built: list[tuple[Any, str | None]] | None = None) -> Prepared:
        """The model runners' walk up to the call under test (specs, plan, add KV-sharing layers, pick kernel sizes); the
        returned Prepared allocates the raw buffers and makes the V2 runner's views when called."""
        if case.spec_source == "vllm":
            assert self.layer_specs is not None
            made: list[tuple[Any, str | None]] = list(self.layer_specs.build(case))
        else:
            made = [(self.build_spec(g.spec), None) for g in case.groups]
        if built is not None:
            built.extend(made)
        specs = [spec for spec, _ in made]
        group_specs = [self.group_level_spec(case, g, spec) for g, spec in zip(case.groups, specs, strict=True)]
        groups = self.group_specs(case, group_specs)
        self.config.cache_config.num_gpu_blocks_override = case.num_blocks
        self.configure_layout(case.layout)
        with self.packing(case):
            config = self.plan(groups, case.num_blocks)
        if case.kv_sharing:
            self.sharing(dict(case.kv_sharing), config.kv_cache_groups)  # type: ignore[misc]
        attn_groups = [self.attention_groups(case, index, group, spec, config)
                       for index, (group, spec) in enumerate(zip(case.groups, specs, strict=True))]
        if "kernel-block choice" in self.off:
            kernel_block_sizes = [g.kernel_block_size or g.spec.block_size for g in case.groups if g.spec.kind != "encoder_only"]
            used, broken = dict(enumerate(kernel_block_sizes)), {}
        else:
            try:
                kernel_block_sizes = self.kernel_choice(config, attn_groups)  # type: ignore[misc]
                used = self.kernel_sizes_used(attn_groups, kernel_block_sizes)
            except ValueError as error:  # vLLM's rule finds no kernel block size for a backend: the case states one
                if stated_kernel_sizes_declared(case, attn_groups):
                    raise  # vLLM refuses a size the backend declares: judged as vLLM's refusal
                stated = [g.kernel_block_size or g.spec.block_size for g in case.groups]
                raise CaseMismatch(f"kernel_block_size: the case says {stated}, vLLM derives none ({error})".splitlines()[0]) from None
            broken = check_derived_kernel_sizes(case, used, lambda index: declared_kernel_sizes(attn_groups, index))
        return Prepared(config, attn_groups, kernel_block_sizes, used,
                        lambda: self.make_views(case, config, attn_groups, kernel_block_sizes, device),
                        lambda memory: self.replan(case, self.group_specs(case, group_specs), memory), broken)

    @contextlib.contextmanager
    def packing(self, case: Case) -> Iterator[None]:
        """The connector setting that asks the planner for cross-layer blocks (case packing "cross_layers"), while planning."""
        if case.packing != "cross_layers" or self.transfer_config is None:
            yield
            return
        previous = self.config.kv_transfer_config
        self.config.kv_transfer_config = self.transfer_config(kv_connector_extra_config={"enable_cross_layers_blocks": "true"})
        try:
            yield
        finally:
            self.config.kv_transfer_config = previous

    def kernel_sizes_used(self, attn_groups: list[list[Any]], kernel_block_sizes: list[int]) -> dict[int, int]:
        """Each group's kernel block size as vLLM derives it for the views it binds."""
        return dict(enumerate(kernel_block_sizes))

    def plan(self, groups: list[Any], num_blocks: int) -> Any:
        assert self.planner is not None
        budget = num_blocks if self.planner.takes("num_blocks") else AVAILABLE_MEMORY
        return self.planner.obj(self.config, groups, budget)

    def group_specs(self, case: Case, specs: list[Any]) -> list[Any]:
        """vLLM's KVCacheGroupSpecs of the case's groups: new ones each time (the shared-layer wiring adds to a planned
        config's groups in place)."""
        return [self.group_spec(list(g.layers), spec) for g, spec in zip(case.groups, specs, strict=True)]

    def replan(self, case: Case, groups: list[Any], memory: int) -> Any:
        """The groups planned again from `memory` bytes with the block-count override unset (planners that take memory)."""
        cache_config = self.config.cache_config
        override, cache_config.num_gpu_blocks_override = cache_config.num_gpu_blocks_override, None
        try:
            with self.packing(case):
                return self.planner.obj(self.config, groups, memory)  # type: ignore[union-attr]
        finally:
            cache_config.num_gpu_blocks_override = override

    def configure_layout(self, layout: str) -> None:
        pass

    def attention_groups(self, case: Case, index: int, group: GroupCase, spec: Any, config: Any) -> list[Any]:
        """The group's AttentionGroups as the model runner forms them: one per per-layer spec (layers that differ in size
        form one each; a KV-sharing layer joins its target's)."""
        if self.attention_group is None:
            return []
        backend = self.backend_class(group) or self.base_backend
        members = config.kv_cache_groups[index].layer_names
        per_layer = getattr(config.kv_cache_groups[index].kv_cache_spec, "kv_cache_specs", None)
        if not group.differs_per_layer or per_layer is None:
            return [self.attention_group.obj(backend=backend, layer_names=list(members), kv_cache_spec=spec, kv_cache_group_id=index)]
        targets = dict(case.kv_sharing)
        by_spec: dict[Any, list[str]] = {}
        for name in members:
            by_spec.setdefault(per_layer[targets.get(name, name)], []).append(name)
        return [self.attention_group.obj(backend=backend, layer_names=names, kv_cache_spec=layer_spec, kv_cache_group_id=index)
                for layer_spec, names in by_spec.items()]

    def record(self, views: dict[str, Any], raw: list[torch.Tensor], sharing: dict[str, str], used: dict[int, int]) -> Outcome:
        pointers = {storage_key(buffer): i for i, buffer in enumerate(raw)}
        records: dict[str, tuple[ViewRecord, ...]] = {}
        owners: dict[int, str] = {}
        aliases: dict[str, str] = {}
        layers_on: list[list[str]] = [[] for _ in raw]
        for name, value in views.items():
            tensors = value if isinstance(value, (list, tuple)) else [value]
            records[name] = tuple(record_view(t, pointers) for t in tensors)
            first = id(tensors[0]) if tensors else 0
            if first in owners:
                aliases[name] = owners[first]
            else:
                owners[first] = name
            for buffer in {r.buffer for r in records[name] if r.buffer >= 0}:
                layers_on[buffer].append(name)
        buffers = tuple(BufferRecord(size=b.untyped_storage().nbytes(), layers=tuple(layers)) for b, layers in zip(raw, layers_on, strict=True))
        return Outcome(views=records, buffers=buffers, kernel_block_sizes=used, aliases=aliases)
