#!/usr/bin/env python
"""Search the parallel layout for a model on a cluster (thin wrapper over mpformer.cli.autoconfig).

    tools/autoconfig.py model=NAME cluster=NAME autoconfig.nodes=N train.global_batch_size=B train.seq_length=S
                        [autoconfig.fixed.<field>=V ...] [autoconfig.output=plan.json] [autoconfig.plot=F.png]
"""

import sys

from mpformer.cli.autoconfig import main

if __name__ == "__main__":
    sys.exit(main())
