"""Gated DeltaNet core: chunked prefill and per-row recurrent (decode / verify).

`reference.py` is the jnp twin (what the `xla` forward runs), `pallas_gpu.py` the Pallas kernels and
their tiling, `api.py` the entry points, refusal checks and contracts exported here.
"""

from kernels_pallas.gdn.api import (
    CHUNK_CONTRACT,
    MAX_ROWS,
    ROWS_CONTRACT,
    chunk_gated_delta_rule,
    gdn_chunk_supported,
    gdn_rows_supported,
    recurrent_gated_delta_rule,
)
from kernels_pallas.gdn.pallas_gpu import ChunkTiling, RowsTiling

__all__ = [
    "CHUNK_CONTRACT",
    "MAX_ROWS",
    "ROWS_CONTRACT",
    "ChunkTiling",
    "RowsTiling",
    "chunk_gated_delta_rule",
    "gdn_chunk_supported",
    "gdn_rows_supported",
    "recurrent_gated_delta_rule",
]
