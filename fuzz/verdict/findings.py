"""Findings: one disagreement between vLLM and the oracle, with a stable signature."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

KINDS = (
    "crash-signal",
    "hang",
    "oom",
    "spec-mismatch",
    "crash-on-valid",
    "crash-on-invalid",
    "accepted-invalid",
    "out-of-bounds",
    "alias",
    "shape",
    "dtype",
    "block-partition",
    "page-escape",
    "share",
    "order",
    "probe-mismatch",
)

PROCESS_KINDS = ("crash-signal", "hang", "oom")  # the target process died, hung or ran out of memory

_NUMBERS = re.compile(r"\d+")


def normalize(message: str) -> str:
    """The message with numbers and object addresses stripped, so one bug has one signature."""
    text = re.sub(r"0x[0-9a-fA-F]+", "#", message)
    return _NUMBERS.sub("#", text).strip()


@dataclass(frozen=True)
class Finding:
    kind: str
    spec_kind: str
    function: str
    message: str
    layer: str | None = None
    latent: bool = False

    @property
    def signature(self) -> str:
        """kind | spec kind | function | message without numbers."""
        return " | ".join((self.kind, self.spec_kind, self.function, normalize(self.message)))

    @property
    def signature_id(self) -> str:
        return hashlib.sha256(self.signature.encode()).hexdigest()[:12]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Finding:
        return cls(data["kind"], data["spec_kind"], data["function"], data["message"], data.get("layer"), bool(data.get("latent")))

    def to_dict(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "spec_kind": self.spec_kind,
            "function": self.function,
            "message": self.message,
            "layer": self.layer,
            "latent": self.latent,
            "signature": self.signature,
            "signature_id": self.signature_id,
        }
