"""Model definitions: shipped architecture configs and the shapes the latency model needs."""

from .shapes import (
    BUILTIN_MODELS,
    ModelShapes,
    check_attention,
    check_trainable,
    load_shapes,
    model_config,
    unsupported_attention,
)

__all__ = [
    "BUILTIN_MODELS",
    "ModelShapes",
    "check_attention",
    "check_trainable",
    "load_shapes",
    "model_config",
    "unsupported_attention",
]
