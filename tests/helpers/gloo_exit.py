"""One process of tests/test_process_exit.py (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set by
the test): a gloo group started by `Distributed`, held on to by an object cppo does not know of,
asynchronous all-reduces of temporaries that the worker threads finish, and release the last
references of, while the process exits, and an exit that leaves the group to cppo's exit handler,
as a script that never calls close() does. The main thread keeps the interpreter's lock between
thread switches for long, so a worker is late to release what it holds.
"""

import sys

import torch

from cppo.parallel.processes import Distributed


def main() -> None:
    global HELD
    Distributed.from_environment()
    HELD = torch.distributed.group.WORLD   # outlives destroy_process_group: cppo cannot release it
    sys.setswitchinterval(1000.0)
    for _ in range(20):   # not waited for: the workers finish them while the process exits
        torch.distributed.all_reduce(torch.ones(1000), async_op=True)


HELD = None
if __name__ == "__main__":
    main()
