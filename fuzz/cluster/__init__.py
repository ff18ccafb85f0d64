"""Campaigns over a Ray cluster: one actor per node holding a local pool (actor), the coordinator's
view of them (pool, members), the spare used for shrinking (spare) and connecting (connect)."""
