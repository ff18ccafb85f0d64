"""`kvfuzz surface`: the KV-cache surface of a vLLM release, found from its source, and how much of it kvfuzz drives.

find.py      the search rules: which functions allocate, view, reshape, re-stride, zero, copy, register or hand out KV caches
reasons.py   why a function kvfuzz does not drive is not driven (rules by path and name)
coverage.py  which of those functions a campaign's cases run, and which lines (a traced process with the target's vLLM)
survey.py    the three together: one map per vLLM
report.py    text and JSON
command.py   the command
"""
