"""Thread counters and stored contexts: the state backends of SPEC §2 (memory, sqlite, redis)."""
