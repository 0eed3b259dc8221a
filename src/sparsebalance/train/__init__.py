"""The distributed trainer: ``torchrun -m sparsebalance.train`` or ``sparsebalance train``."""

from .config import TrainConfig
from .config_io import add_train_arguments, config_from_args
from .trainer import Trainer

__all__ = ["TrainConfig", "Trainer", "add_train_arguments", "config_from_args"]
