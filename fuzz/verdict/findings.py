"""Findings: one disagreement between vLLM and the oracle, with a stable signature."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from fuzz.case import Case, names_in_messages

KINDS = [
    "crash-signal",
    "hang",
    "oom",
    "spec-mismatch",
    "crash-on-valid",
    "crash-on-invalid",
    "refused-valid",
    "assert-on-invalid",
    "declaration",
    "accepted-invalid",
    "buffer-size",
    "out-of-bounds",
    "alias",
    "shape",
    "dtype",
    "block-partition",
    "page-escape",
    "share",
    "order",
    "probe-mismatch",
    "runner-mismatch",
    "zero-escape",
    "zero-miss",
    "copy-escape",
    "copy-wrong",
    "region-mismatch",
    "kernel-crash",
    "kernel-escape",
    "kernel-miss",
    "kernel-order",
    "planner-fit",
    "kernel-block-choice",
]

# What each kind means, in one line (SARIF rules, reports).
DESCRIPTIONS = {
    "crash-signal": "The target process died of a signal (segfault, abort) or exited.",
    "hang": "The target did not finish the case within the case timeout.",
    "oom": "The target process ran out of memory.",
    "spec-mismatch": ("vLLM built a KV-cache spec whose quant mode or page is not what the case's cache dtype defines, "
                      "or, from a layer, whose class or fields are not what the layer's model parameters give."),
    "crash-on-valid": "vLLM raised on a KV-cache configuration it must support.",
    "crash-on-invalid": "vLLM failed deep inside torch or arithmetic on a configuration it should refuse with a message.",
    "refused-valid": "vLLM refused a KV-cache configuration its layout contract expresses.",
    "assert-on-invalid": "vLLM refused an inexpressible configuration by an assertion instead of a ValueError with a message.",
    "declaration": "A backend declared a cache shape, stride order or page fields that break the layout contract.",
    "accepted-invalid": "vLLM built views for a configuration its layout contract cannot express.",
    "buffer-size": ("vLLM's backing KV-cache buffer is not the size its layout spans (more wastes the memory budget; on ROCm it "
                    "must be whole 4096-byte pages)."),
    "out-of-bounds": "A view addresses bytes outside its raw KV-cache buffer.",
    "alias": "Distinct elements of one view share bytes.",
    "shape": "A view's shape is not the declared one.",
    "dtype": "A view's dtype is not the declared one.",
    "block-partition": "A block's kernel blocks do not cover exactly that block's bytes.",
    "page-escape": "A block's bytes leave its page or reach its padding.",
    "share": "A KV-sharing layer does not alias its target layer's cache.",
    "order": "Elements inside a block are not in the declared order.",
    "probe-mismatch": "Bytes written through vLLM's views land where the oracle says they must not.",
    "runner-mismatch": "vLLM's two model runners (V2 and V1) lay the same case out differently, or one refuses what the other builds.",
    "zero-escape": "Zeroing a freed KV block changed bytes outside that block.",
    "zero-miss": "Zeroing a freed KV block left some of that block's bytes uncleared.",
    "copy-escape": "Copying one KV block onto another changed bytes outside the destination block.",
    "copy-wrong": "After a KV block copy the destination block does not hold the source block's bytes.",
    "region-mismatch": "A KV connector's transfer region for a block is not exactly that block's bytes.",
    "kernel-crash": "A backend's cache write raised on a KV-cache view vLLM built for it.",
    "kernel-escape": "A backend's cache write put bytes outside the written token's block or head.",
    "kernel-miss": "A backend's cache write left elements of the token unwritten.",
    "kernel-order": "A backend's cache write put an element elsewhere in its block than the layout places it.",
    "kernel-block-choice": ("vLLM picked another kernel block size than its own rule (the manager block where the backend takes it, else "
                            "the largest declared size dividing it); the views at its size are right, so it costs speed, not bytes."),
    "planner-fit": ("Planned from memory (no block-count override), the cache holds not the blocks the memory fits, or tensors of other "
                    "sizes; or planned with the override, not its blocks (an attention-free model: not the one null block)."),
}

PROCESS_KINDS = ("crash-signal", "hang", "oom")  # the target process died, hung or ran out of memory


@dataclass(frozen=True)
class Reruns:
    """How many fresh processes a failure must fail in again before it counts."""

    ci: int = 2  # `kvfuzz ci`: every failure, whatever its kind (fewer than all: flaky)
    process: tuple[tuple[str, int], ...] = (("hang", 2),)  # a campaign: a process finding of this kind (the other kinds: 1)

    def of_kind(self, kind: str) -> int:
        return dict(self.process).get(kind, 1)


RERUNS = Reruns()

# How bad a kind is: "error" (vLLM builds or crashes on something wrong) or "warning" (vLLM refuses
# a case the contract expresses, or refuses an inexpressible one by an assertion instead of the
# ValueError it promises). A campaign's --fail-on decides which severities fail it.
SEVERITIES = ("warning", "error")
WARNINGS = ("refused-valid", "assert-on-invalid", "kernel-block-choice")
SEVERITY = {kind: "warning" if kind in WARNINGS else "error" for kind in KINDS}


def add_kinds(meanings: Mapping[str, str], warnings: Iterable[str] = ()) -> None:
    """The finding kinds a deeper check reports beyond these, with what each means and which are warnings (the registry,
    fuzz/checks/registry.py, adds every check's when it is imported)."""
    for kind, meaning in meanings.items():
        if kind not in KINDS:
            KINDS.append(kind)
        DESCRIPTIONS[kind] = meaning
        SEVERITY[kind] = "warning" if kind in set(warnings) else "error"

_NUMBERS = re.compile(r"\d+")
_CONSTANT = re.compile(r"(?<![\w:<])[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+(?![\w:>])")
# torch's scalar type names as its errors spell them ("to view Char as BFloat16"): the dtype is the variant, not the bug.
_TORCH_DTYPE = re.compile(r"(?<![\w<])(?:Byte|Char|Short|Int|Long|Half|Float|Double|BFloat16|Bool|UInt\d+|Complex(?:Half|Float|Double)"
                          r"|Float8_\w+|Float4_\w+)(?![\w>])")


def normalize(message: str, backends: Iterable[str] = (), layout: str | None = None) -> str:
    """The message as a template: numbers, object addresses, constant names (backends, environment
    variables, enum members: `FLASH_ATTN`, `VLLM_KV_CACHE_LAYOUT`), torch's dtype names, the variant's own backend and
    layout stripped, so one bug has one signature (a refusal that names the backend or layout it
    refuses is one refusal on every backend and layout)."""
    text = re.sub(r"0x[0-9a-fA-F]+", "#", message)
    names = {name: "<name>" for backend in set(backends) - {"", "-"} for name in names_in_messages(backend)}
    if layout:
        names[layout] = "<layout>"
    for name in sorted(names, key=len, reverse=True):
        text = re.sub(rf"(?<![\w:]){re.escape(name)}(?![\w:])", names[name], text)
    text = _CONSTANT.sub("<name>", text)
    text = _TORCH_DTYPE.sub("<dtype>", text)
    return _NUMBERS.sub("#", text).strip()


@dataclass(frozen=True)
class Finding:
    """One thing vLLM did wrong on one case. The signature names the bug (what went wrong, where, and
    how vLLM said it); the spec kind, backend and layout it showed under are the variant, and
    one bug met under several variants is still one finding."""

    kind: str
    spec_kind: str
    function: str
    message: str
    layer: str | None = None
    latent: bool = False
    backend: str | None = None
    layout: str | None = None

    @property
    def signature(self) -> str:
        """kind | function | message without numbers (the error type leads an exception's message)."""
        return " | ".join((self.kind, self.function, normalize(self.message, (self.backend or "").split("+"), self.layout)))

    @property
    def variant(self) -> tuple[str, str, str]:
        """Where this occurrence showed: (spec kind, backend, layout)."""
        return self.spec_kind, self.backend or "-", self.layout or "-"

    @property
    def severity(self) -> str:
        return SEVERITY.get(self.kind, "error")

    @property
    def signature_id(self) -> str:
        return hashlib.sha256(self.signature.encode()).hexdigest()[:12]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Finding:
        return cls(data["kind"], data["spec_kind"], data["function"], data["message"], data.get("layer"), bool(data.get("latent")),
                   data.get("backend"), data.get("layout"))

    def to_dict(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "spec_kind": self.spec_kind,
            "function": self.function,
            "message": self.message,
            "layer": self.layer,
            "latent": self.latent,
            "backend": self.backend,
            "layout": self.layout,
            "severity": self.severity,
            "signature": self.signature,
            "signature_id": self.signature_id,
        }


def observed(case: Case, kind: str, function: str, message: str, layer: str | None = None) -> Finding:
    """A finding on `case`, with the variant it shows under: the spec kind and backend of `layer`'s
    group (of every group when no layer is named) and the case's layout."""
    owner = dict(case.kv_sharing).get(layer, layer) if layer is not None else None
    groups = [case.groups[case.group_of(owner)]] if owner in case.layer_names else list(case.groups)
    spec_kind = "+".join(sorted({g.spec.kind for g in groups})) or "attention-free"
    backend = "+".join(sorted({g.backend_name for g in groups if g.spec.kind != "mamba"})) or "-"
    return Finding(kind, spec_kind, function, message, layer, case.is_latent, backend, case.layout)


def variants_of(found: Iterable[Finding | tuple[str, str, str]]) -> dict[str, list[str]]:
    """The spec kinds, backends and layouts a bug showed under, each sorted (what a report and a corpus file list)."""
    triples = [f.variant if isinstance(f, Finding) else tuple(f) for f in found]
    return {"spec_kinds": sorted({t[0] for t in triples}), "backends": sorted({t[1] for t in triples} - {"-"}),
            "layouts": sorted({t[2] for t in triples} - {"-"})}
