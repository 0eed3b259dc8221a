"""SparseBalance: balanced data-parallel long-context training with dynamic block-sparse attention.

The data flow (one module per stage) is described in the README; the attention op lives in
:mod:`sparsebalance.ops`.
"""

__version__ = "0.1.0"

__all__ = ["attach", "hf", "shutdown"]


def __getattr__(name: str):
    """``sparsebalance.attach``, ``sparsebalance.hf`` and ``sparsebalance.shutdown`` load on
    first use (they import transformers or torch; ``import sparsebalance`` alone stays light)."""
    if name == "attach":
        from .integrations.attach import attach

        return attach
    if name == "shutdown":
        from .integrations.shutdown import shutdown

        return shutdown
    if name == "hf":
        import importlib

        return importlib.import_module(".hf", __name__)
    raise AttributeError(f"module 'sparsebalance' has no attribute {name!r}")
