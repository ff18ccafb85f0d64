"""Findings handed to vLLM: standalone pytest modules that import only vllm and torch (`kvfuzz export`), Markdown
issue drafts (`kvfuzz report`) and the reach class every finding carries (reach.py)."""
