"""Where the loaded vLLM keeps each function and class kvfuzz drives, found by probing.

Every entry point is looked up by its name: first in the modules where releases have kept it,
then in every module of vLLM's worker-side packages whose source defines that name at top
level. A function also has to accept what kvfuzz passes (its signature, read through
`inspect.unwrap`), so a renamed or wrapped function is found where it went and a changed
signature is noticed instead of being called wrongly. Nothing here depends on the version
string: a checkout in the middle of a refactor is probed like a release.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from fuzz.errors import TargetError
from fuzz.homes import INTERFACE, homes
from fuzz.targets.calls import hidden_parameters

# Packages searched by source when an entry point is not in any of its usual modules.
SEARCHED_PACKAGES = ("vllm.v1", "vllm.model_executor", "vllm.config", "vllm.models")


@dataclass(frozen=True)
class Wanted:
    """One entry point: its names (newest first) and for a function the parameters it must take (each entry a set of
    accepted spellings); the modules releases kept it in are fuzz/homes.py's."""

    role: str
    names: tuple[str, ...]
    params: tuple[tuple[str, ...], ...] = ()
    # For a class: attributes it must have.
    attributes: tuple[str, ...] = ()
    # The parameters decide how kvfuzz calls it (which generation, which arguments): a signature
    # that forwards *args / **kwargs cannot say, so it stops kvfuzz instead of being guessed at.
    exact: bool = False
    # Where a name fuzz/homes.py does not list usually lives (a spec class: the interface module).
    usual: tuple[str, ...] = ()

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((*homes(*self.names), *self.usual)))


@dataclass(frozen=True)
class Found:
    role: str
    obj: Any
    module: str
    name: str
    parameters: tuple[str, ...] = ()

    def takes(self, parameter: str) -> bool:
        return parameter in self.parameters

    @property
    def where(self) -> str:
        return f"{self.module}.{self.name}"


ENTRY_POINTS: dict[str, Wanted] = {w.role: w for w in (
    Wanted("planner", ("get_kv_cache_config_from_groups",),
           params=(("vllm_config",), ("kv_cache_groups",), ("available_memory", "num_blocks")), exact=True),
    Wanted("kernel-block choice", ("prepare_kernel_block_sizes",), params=(("kv_cache_config",), ("attn_groups",))),
    Wanted("common block size", ("select_common_block_size",), params=(("kv_manager_block_size",), ("backends",)),
           exact=True),
    Wanted("allocation", ("allocate_kv_cache",), params=(("kv_cache_config",), ("device",), ("layout",))),
    Wanted("view creation", ("create_kv_cache_views",), params=(("spec",), ("num_blocks",), ("layout",))),
    Wanted("kernel-block mapping", ("map_kv_caches_to_kernel_blocks",), params=(("kv_caches",), ("attn_groups",))),
    Wanted("shared-layer wiring", ("add_kv_sharing_layers_to_kv_cache_groups",),
           params=(("shared_kv_cache_layers",), ("kv_cache_groups",))),
    Wanted("spec customization", ("customize_attention_spec",), params=(("backend",), ("spec", "kv_cache_spec"))),
    # Code that addresses KV blocks by bytes beyond the views (fuzz/targets/consumers.py, kernel_probe.py).
    Wanted("block zeroer", ("KVBlockZeroer",), attributes=("zero_block_ids",)),
    Wanted("CPU block zeroer", ("CPUKVBlockZeroer",), attributes=("zero_block_ids",)),
    Wanted("CPU model runner", ("CPUModelRunner",), attributes=("_zero_block_ids",)),
    Wanted("block copy", ("copy_kv_cache_blocks_inplace",),
           params=(("kv_caches",), ("num_blocks",), ("kv_cache_block_copies",))),
    Wanted("offloading worker", ("OffloadingConnectorWorker",),
           attributes=("register_kv_caches",)),
    Wanted("legacy allocation", ("_allocate_kv_cache",), params=(("kv_cache_config",), ("device",)), exact=True),
    Wanted("legacy reshape", ("_reshape_kv_cache",), params=(("kv_cache_raw_tensors",), ("cache_dtype",)), exact=True),
    Wanted("legacy layout hint", ("set_kv_cache_layout",), params=(("cache_layout",),)),
    Wanted("KVCacheLayout", ("KVCacheLayout",), attributes=("LBNHC",)),
    Wanted("AttentionGroup", ("AttentionGroup",), attributes=()),
    Wanted("AttentionBackend", ("AttentionBackend",),
           attributes=("get_supported_kernel_block_sizes",)),
    Wanted("MultipleOf", ("MultipleOf",), attributes=()),
    Wanted("VllmConfig", ("VllmConfig",), attributes=("cache_config",)),
    Wanted("set_current_vllm_config", ("set_current_vllm_config",), params=(("vllm_config",),)),
    Wanted("KVCacheConfig", ("KVCacheConfig",), attributes=()),
    Wanted("KVCacheGroupSpec", ("KVCacheGroupSpec",), attributes=()),
    Wanted("KVCacheTensor", ("KVCacheTensor",), attributes=()),
    Wanted("AttentionSpec", ("AttentionSpec",), attributes=("page_size_bytes",)),
    Wanted("KVCacheSpec", ("KVCacheSpec",), attributes=("page_size_bytes",)),
    Wanted("KVQuantMode", ("KVQuantMode",), attributes=("NONE",)),
    Wanted("quant-mode lookup", ("get_kv_quant_mode",), params=(("kv_cache_dtype",),)),
    Wanted("cache dtype table", ("STR_DTYPE_TO_TORCH_DTYPE",)),
    Wanted("cache dtype names", ("KV_CACHE_DTYPES", "CacheDType")),
    Wanted("dtype handler registry", ("register_kv_cache_dtype",), params=(("name",),)),
    Wanted("rotary dims", ("register_rope_dim",), params=(("head_size",), ("rope_dim",))),
    Wanted("HiSparse initialisation", ("init_hisparse_kv_cache",), params=(("kv_cache_config",),)),
    # The V1 model runner (GPUModelRunner; CPUModelRunner subclasses it) and what it reaches.
    Wanted("V1 runner", ("GPUModelRunner",), attributes=("initialize_kv_cache_tensors",)),
    Wanted("UniformTypeKVCacheSpecs", ("UniformTypeKVCacheSpecs",), attributes=("is_uniform_type",)),
    Wanted("KVTransferConfig", ("KVTransferConfig",), attributes=()),
    # Specs built by vLLM from layers: the V2 runner's walk over the forward context, and the layers.
    Wanted("layer spec walk", ("get_kv_cache_spec",), params=(("vllm_config",),)),
    Wanted("Attention layer", ("Attention",),
           attributes=("get_kv_cache_spec",)),
    Wanted("MLA layer", ("MLAAttention",),
           attributes=("get_kv_cache_spec",)),
    Wanted("ModelConfig", ("ModelConfig",), attributes=()),
    Wanted("CacheConfig", ("CacheConfig",), attributes=()),
)}


class Probe:
    """Finds entry points in the loaded vLLM; each lookup is done once."""

    def __init__(self, version: str = "?", search: tuple[str, ...] = SEARCHED_PACKAGES) -> None:
        self.version = version
        self.search = search
        self._found: dict[str, Found | None] = {}
        self.searched: dict[str, str] = {}  # role -> where it was looked for, for messages
        self.import_errors: dict[str, str] = {}  # module -> why it did not import here (its first line)

    def find(self, role: str) -> Found | None:
        if role not in self._found:
            self._found[role] = self._locate(ENTRY_POINTS[role])
        return self._found[role]

    def get(self, role: str) -> Any:
        """The entry point itself; TargetError when kvfuzz cannot run without it."""
        found = self.find(role)
        if found is None:
            raise TargetError(f"vLLM {self.version}: {self.missing(role)}; nothing kvfuzz checks can run without it")
        return found.obj

    def located(self) -> dict[str, str]:
        """Every entry point looked up so far that was found: role -> module.name."""
        return {role: found.where for role, found in sorted(self._found.items()) if found is not None}

    def import_failure(self, names: tuple[str, ...]) -> str | None:
        """Why a module whose source defines one of `names` did not import here (`module: error`), or None: a dependency
        that breaks vLLM's import (PyPI's torchvision beside a CPU torch, say) must not read as a vLLM without the code."""
        for module in self._defining_modules(names):
            if module in self.import_errors:
                return f"{module}: {self.import_errors[module]}"
        return None

    def missing(self, role: str) -> str:
        wanted = ENTRY_POINTS[role]
        return f"no {' or '.join(wanted.names)} ({role}) in {self.searched.get(role, ', '.join(wanted.modules))}"

    def spec_class(self, name: str) -> type | None:
        """A KV-cache spec class by name: in the interface module, else wherever vLLM defines it."""
        role = f"spec class {name}"
        if role not in self._found:
            wanted = Wanted(role, (name,), attributes=("page_size_bytes",), usual=(INTERFACE,))
            self._found[role] = self._locate(wanted)
        found = self._found[role]
        return None if found is None else found.obj

    # ------------------------------------------------------------------ lookup

    def _locate(self, wanted: Wanted) -> Found | None:
        for module_name in wanted.modules:
            found = self._check(wanted, module_name)
            if found is not None:
                return found
        searched = [module for module in self._defining_modules(wanted.names) if module not in wanted.modules]
        for module_name in searched:
            found = self._check(wanted, module_name)
            if found is not None:
                return found
        self.searched[wanted.role] = ", ".join(wanted.modules) + f" or any module of {', '.join(self.search)}"
        return None

    def _check(self, wanted: Wanted, module_name: str) -> Found | None:
        try:
            module = importlib.import_module(module_name)
        except Exception as error:  # noqa: BLE001 - a module that does not import here holds nothing usable
            self.import_errors.setdefault(module_name, f"{type(error).__name__}: {error}".splitlines()[0][:300])
            return None
        for name in wanted.names:
            obj = getattr(module, name, None)
            if obj is None or not self._fits(wanted, obj, f"{module_name}.{name}"):
                continue
            home = getattr(obj, "__module__", None) or module_name
            return Found(wanted.role, obj, home if isinstance(home, str) else module_name, name, _parameters(obj))
        return None

    def _fits(self, wanted: Wanted, obj: Any, where: str) -> bool:
        if wanted.attributes and not all(hasattr(obj, attribute) for attribute in wanted.attributes):
            return False
        if not wanted.params:
            return True
        if not callable(obj):
            return False
        parameters, forwards = signature_parameters(obj, where, self.version)
        if forwards and wanted.exact:
            raise TargetError(f"vLLM {self.version}: {where} forwards *args/**kwargs (even unwrapped) and its parameters decide how "
                              "kvfuzz calls it; kvfuzz will not guess")
        # A function that forwards *args / **kwargs takes whatever kvfuzz passes it positionally.
        return forwards or all(any(spelling in parameters for spelling in accepted) for accepted in wanted.params)

    def _defining_modules(self, names: tuple[str, ...]) -> list[str]:
        return sorted({module for name in names for module in self._definitions.get(name, ())})

    @cached_property
    def _definitions(self) -> dict[str, list[str]]:
        """Every name defined at the top level of a searched module (def, class or assignment) ->
        the modules defining it; read once, from the source, without importing anything."""
        pattern = re.compile(r"^(?:(?:async\s+)?def|class)\s+(\w+)|^(\w+)\s*(?::[^=\n]*)?=", re.MULTILINE)
        index: dict[str, list[str]] = {}
        for module_name, path in self._sources:
            try:
                text = path.read_text(errors="replace")
            except OSError:
                continue
            for match in pattern.finditer(text):
                index.setdefault(match.group(1) or match.group(2), []).append(module_name)
        return index

    @cached_property
    def _sources(self) -> list[tuple[str, Path]]:
        """Every .py file of the searched packages, as (module name, path), in a stable order."""
        files: list[tuple[str, Path]] = []
        for package in self.search:
            try:
                spec = importlib.util.find_spec(package)
            except (ImportError, ValueError):
                continue
            for root in (spec.submodule_search_locations or []) if spec else []:
                files += _module_files(package, Path(root))
        return sorted(files)


def _module_files(package: str, root: Path) -> Iterator[tuple[str, Path]]:
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        if any(not part.isidentifier() for part in parts):
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join((package, *parts)), path


def signature_parameters(obj: Any, where: str, version: str) -> tuple[tuple[str, ...], bool]:
    """The named parameters of a function (through its decorators) and whether it also forwards
    *args / **kwargs; TargetError when the signature says nothing (only *args / **kwargs), since
    kvfuzz must never guess a generation."""
    try:
        signature = inspect.signature(inspect.unwrap(obj))
    except (TypeError, ValueError):
        raise TargetError(f"vLLM {version}: cannot read the signature of {where}; kvfuzz will not guess how to call it") from None
    named = tuple(p.name for p in signature.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
    if not named and signature.parameters:
        raise TargetError(f"vLLM {version}: {hidden_parameters(where, signature)}")
    return named, len(named) != len(signature.parameters)


def _parameters(obj: Any) -> tuple[str, ...]:
    if not callable(obj) or inspect.isclass(obj):
        return ()
    try:
        return tuple(inspect.signature(inspect.unwrap(obj)).parameters)
    except (TypeError, ValueError):
        return ()
