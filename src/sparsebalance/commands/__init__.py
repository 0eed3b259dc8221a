"""One module per ``sparsebalance`` command: ``add_arguments(parser)`` and ``main(args) -> int``."""
