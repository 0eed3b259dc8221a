"""Model definitions: shipped architecture configs and the shapes the latency model needs."""

from .shapes import (
    BUILTIN_MODELS,
    SUPPORTED_MODEL_TYPES,
    ModelShapes,
    check_attention,
    check_model_type,
    check_trainable,
    load_shapes,
    model_config,
    unsupported_attention,
)

__all__ = [
    "BUILTIN_MODELS",
    "SUPPORTED_MODEL_TYPES",
    "ModelShapes",
    "check_attention",
    "check_model_type",
    "check_trainable",
    "load_shapes",
    "model_config",
    "unsupported_attention",
]
