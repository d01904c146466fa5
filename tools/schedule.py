#!/usr/bin/env python
"""Build, verify and simulate a pipeline schedule (thin wrapper over mpformer.cli.schedule).

    tools/schedule.py --schedule NAME --pp P --microbatches M [--vpp V] [--f 1 --b 1 --w 1 --p2p 0]
                      [--json F] [--plot F.png] [--trace F.json] [--print]
"""

import sys

from mpformer.cli.schedule import main

if __name__ == "__main__":
    sys.exit(main())
