"""Dynamic block-sparse attention: budget -> ``select_blocks`` -> ``BlockLayout`` -> attention.

```python
layout = select_blocks(q, k, cu_seqlens, Budget(gamma=0.9), block_size=64)
out = block_sparse_attention(q, k, v, layout, cu_seqlens)   # (T, Hq, D), differentiable
```
"""

from .attention import available_backends, block_sparse_attention, resolve_backend
from .budget import Budget
from .layout import BlockLayout, causal_block_mask, random_layout
from .select import BlockMassEstimate, attention_recall, estimate_block_mass, select_blocks

__all__ = [
    "BlockLayout",
    "BlockMassEstimate",
    "Budget",
    "attention_recall",
    "available_backends",
    "block_sparse_attention",
    "causal_block_mask",
    "estimate_block_mass",
    "random_layout",
    "resolve_backend",
    "select_blocks",
]
