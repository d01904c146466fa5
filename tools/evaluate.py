"""Evaluate a checkpoint: ``torchrun ... tools/evaluate.py checkpoint.load=DIR eval.tokens=FILE.npy``."""

import sys

from mpformer.cli.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
