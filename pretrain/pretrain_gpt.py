"""Pretrain a GPT-style model: ``torchrun --nproc_per_node=N pretrain/pretrain_gpt.py [hydra overrides]``."""

import sys

from mpformer.cli.pretrain import main

if __name__ == "__main__":
    sys.exit(main())
