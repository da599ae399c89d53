"""One process of tests/test_process_exit.py (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set by
the test), in one of two modes (argv[1]):

* `held`: a gloo group started by `Distributed`, held on to by an object cppo does not know of,
  asynchronous all-reduces of temporaries that the worker threads finish, and release the last
  references of, while the process exits, and an exit that leaves the group to cppo's exit
  handler, as a script that never calls close() does. The main thread keeps the interpreter's
  lock between thread switches for long, so a worker is late to release what it holds.
* `engine:<ddp|fsdp>`: a group started by `Distributed` (torch.distributed.fsdp and
  torch._dynamo imported only after it started, as a script that builds its model late does), a
  cppo Engine over two Linear blocks, a forward, backward and AdamW step (DTensor optimizer state
  under fsdp), then `close()`; prints `gloo threads after close: <n>` (0: the group's destructor
  joined them, nothing held it).
"""

import sys

import torch

from cppo.parallel.processes import Distributed, collective_threads


def held() -> None:
    global HELD
    Distributed.from_environment()
    HELD = torch.distributed.group.WORLD   # outlives destroy_process_group: cppo cannot release it
    sys.setswitchinterval(1000.0)
    for _ in range(20):   # not waited for: the workers finish them while the process exits
        torch.distributed.all_reduce(torch.ones(1000), async_op=True)


def engine(strategy: str) -> None:
    assert "torch.distributed.fsdp" not in sys.modules and "torch._dynamo" not in sys.modules
    dist = Distributed.from_environment()
    from cppo.parallel.engines import Engine
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    eng = Engine(strategy, dist, model, block_names=["Linear"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        eng.forward(lambda policy, x: policy(x), torch.randn(4, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    dist.close()
    print(f"gloo threads after close: {collective_threads()}", flush=True)


HELD = None
if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "held"
    held() if mode == "held" else engine(mode.split(":", 1)[1])
