"""Create the store, then do nothing with it for argv[1] seconds (a worker busy elsewhere),
then close it."""

import sys
import time

import kvstore

kv = kvstore.create("dist_sync")
kv.barrier()
print("ready", flush=True)
time.sleep(float(sys.argv[1]))  # the idle time itself, not a wait for something
kv.close()
print("OK", flush=True)
