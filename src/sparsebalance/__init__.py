"""SparseBalance: balanced data-parallel long-context training with dynamic block-sparse attention.

The data flow (one module per stage) is described in the README; the attention op lives in
:mod:`sparsebalance.ops`.
"""

__version__ = "0.1.0"

__all__ = ["attach", "hf"]


def __getattr__(name: str):
    """``sparsebalance.attach`` and ``sparsebalance.hf`` load on first use (they import
    transformers; ``import sparsebalance`` alone stays light)."""
    if name == "attach":
        from .integrations.attach import attach

        return attach
    if name == "hf":
        import importlib

        return importlib.import_module(".hf", __name__)
    raise AttributeError(f"module 'sparsebalance' has no attribute {name!r}")
