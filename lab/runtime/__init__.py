"""Running one model: its weights (a float32 master, dtype casts, adapter merges), its CPU plan (decided by
probes on this machine), the CPU worker pool, and the forward that ties them (``runner.Runner``); the opt-in
process allocator tuning (``allocator``). Knows models and ops, never the engine."""
