#!/usr/bin/env python3
"""Start a kvstore job, as MXNet's tools/launch.py did. See ``python launch.py -h``.

python launch.py -n 2 -s 2 --launcher ssh -H hosts python train.py --kv-store dist_sync
"""

import sys

from kvstore.launch.cli import main

if __name__ == "__main__":
    sys.exit(main())
