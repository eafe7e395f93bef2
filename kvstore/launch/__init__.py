"""Start a whole job: the scheduler here, then servers and workers through a launcher.

python launch.py -n 2 -s 2 --launcher ssh -H hosts python train.py --kv-store dist_sync
"""

from .cli import main

__all__ = ["main"]
