"""kvfuzz: differential fuzzing of vLLM's KV-cache layout code against an independent oracle."""

from pathlib import Path

__version__ = "0.2.0"

# The folder holding the fuzz/ and oracles/ packages: what a worker process needs on its path.
SOURCE_ROOT = Path(__file__).resolve().parent.parent
