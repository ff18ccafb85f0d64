"""Target adapters: one per vLLM API generation, chosen by probing what the loaded vLLM offers (fuzz/targets/loader.py)."""


def __getattr__(name: str):  # TEMPORARY shim while helpers migrate; removed before commit
    if name == "load_local":
        from fuzz.targets.loader import load_local

        return load_local
    raise AttributeError(name)
