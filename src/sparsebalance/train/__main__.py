"""torchrun entry point: ``torchrun --nproc_per_node N -m sparsebalance.train [flags]``."""

import argparse
import sys

from .config import add_train_arguments, config_from_args
from .step import NonFiniteLoss
from .trainer import Trainer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sparsebalance.train")
    add_train_arguments(parser)
    try:
        cfg = config_from_args(parser.parse_args(argv))
        trainer = Trainer(cfg)
        trainer.run()
        trainer.rt.close()
    except ValueError as err:
        print(f"sparsebalance train: error: {err}", file=sys.stderr)
        return 2
    except NonFiniteLoss as err:
        print(
            f"sparsebalance train: stopped: {err}; the last checkpoint is intact", file=sys.stderr
        )
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
