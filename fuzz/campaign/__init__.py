"""The campaign engine: the coordinator (engine), the worker processes it drives (pool, worker,
protocol), and what it prints and writes (progress, junit); selftest and bench run campaigns."""
