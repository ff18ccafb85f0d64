"""`kvfuzz mutate`: would kvfuzz catch a bug in this function?

Single-edit mutants of vLLM's layout functions (operators), each written into a copy of the
target's tree (tree), are fuzzed by ordinary campaigns; a mutant is killed when its campaign finds
what the unmutated code does not (session). Survivors show where kvfuzz is blind (report).
"""
