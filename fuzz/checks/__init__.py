"""The deeper checks: vLLM code beyond the view path (block zeroers, the block copy, connectors, cache writes, the
planner asked again, the other model runner), each one module behind fuzz/checks/protocol.py's `Check`, listed once in
fuzz/checks/registry.py's CHECKS. Adding a check is adding a module here and naming it there (docs/architecture.md)."""
