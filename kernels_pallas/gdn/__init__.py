"""Gated DeltaNet core: chunked prefill and per-row recurrent (decode / verify)."""
