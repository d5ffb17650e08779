"""ringflash: exact attention over sequences sharded across a process group.

    out = ringflash.ring_flash_attn(q, k, v, causal=True)      # layout "zigzag", the default
    sp = ringflash.SequenceParallel(group)                       # the group and layout, once

q, k, v are this rank's shards (batch, seqlen_local, heads, head_dim); K/V shards
travel around the ring of ranks while each rank runs a FlashAttention kernel on its
queries against the visiting keys.
"""

from .api import (positions, ring_flash_attn, segment_ids_from_cu_seqlens,
                  segment_ids_from_position_ids, shard, unshard)
from .documents import document_layout
from .exchange import transport
from .kernels import dropout_keep_mask, flash_attn
from .layer import RingSelfAttention, all_reduce_gradients, broadcast_parameters
from .layouts import DEFAULT_LAYOUT, DOCUMENTS_LAYOUT, LAYOUTS
from .parallel import SequenceParallel

__version__ = "0.1.0"
__all__ = ["DEFAULT_LAYOUT", "DOCUMENTS_LAYOUT", "LAYOUTS", "RingSelfAttention", "SequenceParallel",
           "all_reduce_gradients", "broadcast_parameters", "document_layout", "dropout_keep_mask", "flash_attn",
           "positions", "ring_flash_attn", "segment_ids_from_cu_seqlens",
           "segment_ids_from_position_ids", "shard", "transport", "unshard"]
