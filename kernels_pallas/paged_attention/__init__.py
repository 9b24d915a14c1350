"""Causal attention over a paged KV cache, for prefill chunks, decode rows and verify rows."""
