"""Scheduling: a request's state (sequence), what runs next (scheduler), and the paged KV
blocks it holds (block_pool, kv_cache, hashing)."""
