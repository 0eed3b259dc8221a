"""Dynamic block-sparse attention: budget -> ``select_blocks`` -> ``BlockLayout`` -> attention.

```python
layout = select_blocks(q, k, cu_seqlens, Budget(top_k=8), block_size=64)  # or Budget(gamma=0.9)
out = block_sparse_attention(q, k, v, layout, cu_seqlens)   # (T, Hq, D), differentiable
```
"""

from .attention import available_backends, block_sparse_attention, resolve_backend
from .block_pairs import (
    BlockPairs,
    blocks_to_tokens,
    query_rows,
    rows_to_tokens,
    token_blocks,
)
from .block_sparse_torch import (
    accumulation_dtype,
    block_pairs_backward,
    block_pairs_forward,
    merge_attention,
)
from .budget import KINDS, Budget, topk_density, topk_for_density
from .layout import BlockLayout, causal_block_mask, random_layout
from .select import BlockMassEstimate, attention_recall, estimate_block_mass, select_blocks

__all__ = [
    "KINDS",
    "BlockLayout",
    "BlockMassEstimate",
    "BlockPairs",
    "Budget",
    "accumulation_dtype",
    "attention_recall",
    "available_backends",
    "block_pairs_backward",
    "block_pairs_forward",
    "block_sparse_attention",
    "blocks_to_tokens",
    "causal_block_mask",
    "estimate_block_mass",
    "merge_attention",
    "query_rows",
    "random_layout",
    "resolve_backend",
    "rows_to_tokens",
    "select_blocks",
    "token_blocks",
    "topk_density",
    "topk_for_density",
]
