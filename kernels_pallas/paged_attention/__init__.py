"""Causal attention over a paged KV cache, for prefill chunks, decode rows and verify rows.

`reference.py` is the jnp twin (what the `xla` forward runs) and the KV write, `pallas_gpu.py` the
Pallas kernel, its tiling and body forms, `api.py` the entry points, refusal check and contract
exported here.
"""

from kernels_pallas.paged_attention.api import CONTRACT, paged_attention, paged_attention_supported, write_kv
from kernels_pallas.paged_attention.pallas_gpu import AttentionTiling, Form

__all__ = ["CONTRACT", "AttentionTiling", "Form", "paged_attention", "paged_attention_supported", "write_kv"]
