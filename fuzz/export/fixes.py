"""Fixes kvfuzz proposes for findings no release has fixed yet: shown in `kvfuzz report`'s draft, and applied to a copy
of a release's tree to check that the exported test passes once the bug is gone (tests/test_export.py)."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Fix:
    path: str  # inside the release tree, e.g. vllm/v1/kv_cache_interface.py
    changes: tuple[tuple[str, str], ...]  # (old text, new text), each old text once in the file
    note: str  # one line: what the fix does
    release: str  # the release the text matches

    def diff(self) -> str:
        """The change as a diff of its hunks (no line numbers), for a report."""
        lines = [f"--- a/{self.path}", f"+++ b/{self.path}"]
        for old, new in self.changes:
            lines.append("@@")
            lines += [f"-{line}" for line in old.rstrip("\n").splitlines()]
            lines += [f"+{line}" for line in new.rstrip("\n").splitlines()]
        return "\n".join(lines)


OFFLOADING_WORKER = "vllm/distributed/kv_transfer/kv_connector/v1/offloading/worker.py"

FIXES: dict[str, Fix] = {
    # 10: CUSTOM must be a value of its own, not an alias of OCTAVE_K3V4.
    "d12a95e7e436": Fix("vllm/v1/kv_cache_interface.py", (("    CUSTOM = 12\n", "    CUSTOM = 15\n"),),
                        "give KVQuantMode.CUSTOM a value no other member has", "0.34.0"),
    # 25: a KV-sharing layer owns no entry in UniformTypeKVCacheSpecs.kv_cache_specs; it reads its target's cache.
    "b2cc6e50a21b": Fix(
        OFFLOADING_WORKER, ((
        "                layer_kv_cache_spec = per_layer_specs.get(\n"
        "                    layer_name, group_kv_cache_spec\n"
        "                )\n",
        "                # A KV-sharing layer has no spec of its own: it holds its target's cache.\n"
        "                layer_kv_cache_spec = per_layer_specs.get(layer_name) or next(\n"
        "                    (s for n, s in per_layer_specs.items() if kv_caches[n] is kv_caches[layer_name]),\n"
        "                    group_kv_cache_spec,\n"
        "                )\n"),),
        "look a KV-sharing layer's spec up through its target (the layer whose cache it holds)", "0.34.0"),
    # 18: where the block axis lies inside the head axis (LHBNC), block b of a layer is one run per head slot.
    "047a3fda9528": Fix(
        OFFLOADING_WORKER, ((
        "                tensors_per_block[layer_name] = (\n"
        "                    torch.tensor([], dtype=torch.int8, device=ref.device).set_(\n"
        "                        ref.untyped_storage(),\n"
        "                        byte_offset,\n"
        "                        (num_blocks, page),\n"
        "                        (block_stride_bytes, 1),\n"
        "                    ),\n"
        "                )\n"
        "                page_size_bytes[layer_name] = page\n",
        "                # Where the block axis lies inside the head axis (LHBNC), block b is one run per head slot.\n"
        "                runs = ref.shape[1] if block_stride_bytes < page else 1\n"
        "                tensors_per_block[layer_name] = tuple(\n"
        "                    torch.tensor([], dtype=torch.int8, device=ref.device).set_(\n"
        "                        ref.untyped_storage(),\n"
        "                        byte_offset + run * ref.stride(1) * elem_size,\n"
        "                        (num_blocks, page // runs),\n"
        "                        (block_stride_bytes, 1),\n"
        "                    )\n"
        "                    for run in range(runs)\n"
        "                )\n"
        "                page_size_bytes[layer_name] = page // runs\n"), (
        "                for layer_name, (tensor,) in tensors_per_block.items()\n",
        "                for layer_name, (tensor, *_) in tensors_per_block.items()\n")),
        "register one region per head slot where a layer's block is not one run of its page", "0.34.0"),
    # 19: CPU_MLA's cache write assumes a dense [blocks, tokens, dim] cache: declare the one layout it serves.
    "bd18d3902f47": Fix(
        "vllm/v1/attention/backends/mla/cpu_mla.py", ((
        "    @staticmethod\n    def get_name() -> str:\n        return \"CPU_MLA\"\n",
        "    @classmethod\n    def supported_kv_cache_layouts(cls):\n"
        "        from vllm.v1.kv_cache_layout import KVCacheLayout\n\n"
        "        return (KVCacheLayout.LBNHC,)  # do_kv_cache_update views the cache as dense rows\n\n"
        "    @staticmethod\n    def get_name() -> str:\n        return \"CPU_MLA\"\n"),),
        "declare the layouts CPU_MLA's cache write serves, so vLLM refuses the others up front", "0.34.0"),
}


def fix_for(signature_id: str) -> Fix | None:
    return FIXES.get(signature_id)


def patched_tree(tree: Path, fix: Fix, destination: Path) -> Path:
    """A copy of the release tree at `tree` (the folder holding vllm/) with `fix` applied: files are hard links, the
    patched one a new file. The release's bytecode comes along (a hard link keeps the source's mtime, so it stays valid,
    and Python replaces a stale file instead of writing into it), but the patched module's own. ValueError when the fix's
    text is not in the file exactly once."""
    text = (tree / fix.path).read_text()
    for old, new in fix.changes:
        if text.count(old) != 1:
            raise ValueError(f"{fix.path}: the text the fix replaces is there {text.count(old)} times, not once")
        text = text.replace(old, new)
    shutil.copytree(tree / "vllm", destination / "vllm", copy_function=os.link)
    patched = destination / fix.path
    for bytecode in (patched.parent / "__pycache__").glob(f"{patched.stem}.*.pyc"):
        bytecode.unlink()
    patched.unlink()
    patched.write_text(text)
    return destination
