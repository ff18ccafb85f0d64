"""Every error kvfuzz reports to a user derives from KvfuzzError.

The command line turns these into one line on stderr and exit status 2.
"""


class KvfuzzError(Exception):
    """Base of all user-facing kvfuzz errors."""


class CaseError(KvfuzzError):
    """A case file is malformed or inconsistent; the message names the field."""


class TargetError(KvfuzzError):
    """The requested vLLM target cannot be loaded or used."""


class UsageError(KvfuzzError):
    """An invalid command-line option or combination of options."""


class Inexpressible(KvfuzzError):
    """The target cannot express a case (a skip, never a finding)."""


class CaseMismatch(CaseError):
    """A field the case derives (a kernel block size) differs from what vLLM derives from the same inputs."""


class BrokenDeclaration(KvfuzzError):
    """A backend's declaration breaks the layout contract: a `declaration` finding, not a skip."""

    def __init__(self, function: str, message: str, layer: str | None = None) -> None:
        super().__init__(message)
        self.function = function
        self.layer = layer


class InternalError(TargetError):
    """kvfuzz's own code raised on a case in a worker: a bug to report. The message is the one-line summary naming the
    innermost kvfuzz and vLLM frames (fuzz/tracebacks.py); `traceback` is the worker's traceback."""

    def __init__(self, summary: str, traceback: str = "") -> None:
        super().__init__(summary)
        self.traceback = traceback
