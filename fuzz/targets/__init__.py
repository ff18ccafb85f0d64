"""Target adapters: one per vLLM API generation, chosen by probing what the loaded vLLM offers (fuzz/targets/loader.py)."""
