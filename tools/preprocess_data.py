#!/usr/bin/env python
"""Tokenize .txt/.jsonl files into P.bin + P.idx; see ``mpformer-preprocess --help``."""

import sys

from mpformer.cli.preprocess import main

if __name__ == "__main__":
    sys.exit(main())
