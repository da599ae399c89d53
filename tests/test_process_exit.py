"""A gloo group ended by cppo never aborts the process at exit, even while an object cppo does not
know of still holds it: 2 groups of 2 processes at once, each a script whose gloo worker threads
hold the last references of their collectives' tensors when the exit handler destroys the group
(tests/helpers/gloo_exit.py; the group is held by a module global, as a user's own object can).

The objects cppo makes hold the group too (DDP's reducer, FSDP's module states, every DeviceMesh),
and `Distributed.close()` releases them first (cppo.parallel.engines.Engine.release), so the
group's destructor joins gloo's threads there: tests/test_distributed.py checks that no gloo
thread is left after a real fsdp and ddp run. What cppo cannot release it can only outwait: with
a gloo thread still alive after the group's end, close() waits with the interpreter's lock
released (`drain_collective_threads`). With that drain taken out, 3 or 4 of the 4 processes died
by SIGABRT ("terminate called without an active exception") in each of four runs of this test.
"""

import os
import subprocess
import sys
from pathlib import Path

from cppo.parallel.processes import free_port

GROUPS, WORLD = 2, 2
SCRIPT = Path(__file__).parent / "helpers" / "gloo_exit.py"


def launch(modes: list[str]) -> list[tuple[int, str]]:
    """One group of WORLD processes per mode, all at once: [(exit code, output)] per process."""
    procs = []
    for mode in modes:
        port = str(free_port())
        for rank in range(WORLD):
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank),
                   "WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                   "OMP_NUM_THREADS": "1"}
            procs.append(subprocess.Popen([sys.executable, str(SCRIPT), mode],
                                          env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
    return [(proc.wait(timeout=240), proc.stdout.read()) for proc in procs]


def test_a_gloo_group_still_held_elsewhere_ends_without_an_abort_at_exit():
    ended = launch(["held"] * GROUPS)
    assert [code for code, _ in ended] == [0] * GROUPS * WORLD, \
        "\n".join(out[-800:] for code, out in ended if code)


def test_closing_joins_gloo_threads_after_ddp_and_fsdp_engines():
    """The engine lets go of the group (DDP's reducer; FSDP's states and the meshes of its
    DTensor parameters and optimizer state), and torch.distributed.nn.functional, imported only
    by FSDP after the start in this script, was imported before it: no gloo thread is left after
    close(), so nothing is left for the drain or for interpreter shutdown."""
    ended = launch(["engine:ddp", "engine:fsdp"])
    assert [code for code, _ in ended] == [0] * 2 * WORLD, \
        "\n".join(out[-800:] for code, out in ended if code)
    for code, out in ended:
        assert "gloo threads after close: 0" in out, out[-800:]
