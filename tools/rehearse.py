#!/usr/bin/env python
"""Rehearse ranks of a layout on this CPU as the GPU they would run on (thin wrapper over mpformer.cli.rehearse).

    tools/rehearse.py [pretraining overrides] rehearse.device=h100-80gb rehearse.ranks=[0,7] rehearse.json=F
"""

import sys

from mpformer.cli.rehearse import main

if __name__ == "__main__":
    sys.exit(main())
