"""SparseBalance: balanced data-parallel long-context training with dynamic block-sparse attention.

The data flow (one module per stage) is described in the README; the attention op lives in
:mod:`sparsebalance.ops`.
"""

__version__ = "0.1.0"
