"""Model definitions: shipped architecture configs and the shapes the latency model needs."""

from .shapes import BUILTIN_MODELS, ModelShapes, load_shapes

__all__ = ["BUILTIN_MODELS", "ModelShapes", "load_shapes"]
