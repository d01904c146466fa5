#!/usr/bin/env python
"""Convert checkpoints between Hugging Face and mpformer (thin wrapper over mpformer.cli.convert).

    tools/convert_checkpoint.py hf-to-mpformer --hf DIR --out DIR
    tools/convert_checkpoint.py mpformer-to-hf --ckpt DIR --out DIR [--tokenizer DIR]
"""

import sys

from mpformer.cli.convert import main

if __name__ == "__main__":
    sys.exit(main())
