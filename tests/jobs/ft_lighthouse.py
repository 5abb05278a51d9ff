"""torchft's lighthouse in a process of its own, so that a test can kill it: prints its address, then serves.

Arguments: ``min_replicas join_timeout_ms heartbeat_timeout_ms``.
"""

import sys
import time

from torchft._torchft import LighthouseServer

server = LighthouseServer(
    bind="[::]:0",
    min_replicas=int(sys.argv[1]),
    join_timeout_ms=int(sys.argv[2]),
    heartbeat_timeout_ms=int(sys.argv[3]),
)
print(server.address(), flush=True)
while True:
    time.sleep(1)
