"""The vLLM servers' addresses and connections (`vllm_mode: server`): TRL's VLLMClient on each
`trl vllm-serve` server (or vLLM's server with TRL's flags) the config's vLLM section names --
one URL, or several separated by commas -- and the requests sent to them together, each with a
time limit and any failure naming its server; for adapter pushes (vllm_push: adapter) each
server's LoRA limits checked and the sink built."""

from __future__ import annotations

import queue
import threading
import time
from typing import TYPE_CHECKING, Callable
from urllib.parse import urlparse

from cppo.errors import ConfigError, VLLMServerError, VLLMUnavailableError

if TYPE_CHECKING:
    from cppo.config.sections import VLLMSection

FIELD = "vllm_server_base_url"


def split_urls(text: str) -> list[str]:
    """A vllm_server_base_url value -> its entries, stripped ("http://a:8000, http://b:8001" ->
    two); an empty entry (",," or a trailing comma) is kept as "" for the check to name."""
    return [part.strip() for part in text.split(",")]


def url_problem(entry: str) -> str | None:
    """What is wrong with one entry of vllm_server_base_url (None: a URL such as
    http://host:8000, which the client can reach)."""
    if not entry:
        return "an empty entry (two commas, or one at an end)"
    parsed = urlparse(entry)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        return f"{entry!r} is not a URL such as http://host:8000"
    try:
        parsed.port
    except ValueError:
        return f"{entry!r} has a port that is not a number in 1..65535"
    if not parsed.hostname:
        return f"{entry!r} names no host"
    return None


def server_address(url: str) -> tuple[str, int]:
    """(host, port) of a server's URL, normalised: the host lower-cased, the scheme's port (80,
    443) where none is written; two entries with the same address are the same server."""
    parsed = urlparse(url)
    return parsed.hostname.lower(), parsed.port or (443 if parsed.scheme == "https" else 80)


def server_urls(vllm: VLLMSection) -> list[str]:
    """The servers' addresses from the config's vLLM section: each entry of
    vllm_server_base_url (comma-separated), else http://vllm_server_host:vllm_server_port."""
    if vllm.vllm_server_base_url:
        return split_urls(vllm.vllm_server_base_url)
    return [f"http://{vllm.vllm_server_host}:{vllm.vllm_server_port}"]


def server_url(vllm: VLLMSection) -> str:
    """The servers' addresses as one string (one URL with a single server)."""
    return ",".join(server_urls(vllm))


def connect_server(vllm: VLLMSection, url: str | None = None, index: int = 0):
    """TRL's VLLMClient on one server of the vLLM section (`url`; None: the first), its NCCL
    weight group on port vllm_group_port + index (each server its own); a server that does not
    answer within vllm_server_timeout seconds is a VLLMServerError naming the address and the
    fields that set it."""
    try:
        from trl.generation.vllm_client import VLLMClient
    except ImportError as err:
        raise VLLMUnavailableError("vllm_mode: server talks to `trl vllm-serve` through TRL's "
                                   f"VLLMClient: pip install trl (import failed: {err})") from err
    url = url or server_urls(vllm)[0]
    try:
        return VLLMClient(base_url=url, group_port=vllm.vllm_group_port + index,
                          connection_timeout=vllm.vllm_server_timeout)
    except (ConnectionError, OSError) as err:
        raise VLLMServerError(
            f"vllm_mode: server: no vLLM server answered at {url} within vllm_server_timeout = "
            f"{vllm.vllm_server_timeout} s: start one (`trl vllm-serve --model <the model>`), or "
            f"point {FIELD} (or vllm_server_host / vllm_server_port) at it; {FIELD} is "
            f"{vllm.vllm_server_base_url!r} ({type(err).__name__}: {err})") from err


def connect_servers(vllm: VLLMSection) -> list[tuple[object, str]]:
    """(client, url) of every server the vLLM section names, in its order (connect_server)."""
    return [(connect_server(vllm, url, index), url)
            for index, url in enumerate(server_urls(vllm))]


def client_url(client, default: str) -> str:
    """A client's server address (TRL's VLLMClient.base_url; `default` for one without)."""
    return getattr(client, "base_url", None) or default


def call_servers(calls: list[tuple[str, Callable[[], object]]], timeout: float | None,
                 what: str = "a request") -> list:
    """Run each (url, call) at once, one thread each, and return their results in order. The
    first call to raise is a VLLMServerError naming its server, as soon as it does; calls still
    running after `timeout` seconds (None: no limit) likewise (their threads, daemons, are left to
    end with the process: never a hang)."""
    results: list = [None] * len(calls)
    done: queue.Queue = queue.Queue()

    def run(i: int, call: Callable[[], object]) -> None:
        try:
            results[i] = call()
            done.put((i, None))
        except BaseException as err:   # handed to the caller's thread
            done.put((i, err))

    for i, (_, call) in enumerate(calls):
        threading.Thread(target=run, args=(i, call), daemon=True,
                         name=f"cppo-vllm-server-{i}").start()
    deadline = None if timeout is None else time.monotonic() + timeout
    waiting = set(range(len(calls)))
    while waiting:
        try:
            i, err = done.get(timeout=None if deadline is None
                              else max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            url = ", ".join(calls[j][0] for j in sorted(waiting))
            raise VLLMServerError(
                f"the vLLM server at {url} did not answer {what} within "
                f"vllm_server_request_timeout = {timeout:g} s: it hangs or is overloaded; "
                f"restart it, raise vllm_server_request_timeout, or remove it from {FIELD}"
            ) from None
        waiting.discard(i)
        if err is None:
            continue
        if isinstance(err, (VLLMServerError, TypeError, AttributeError, NameError)):
            raise err   # a server's own message, or a fault on this side
        raise VLLMServerError(
            f"the vLLM server at {calls[i][0]} failed {what} ({type(err).__name__}: {err}); "
            f"check that it still runs (its log), restart it, or remove it from {FIELD}") from err
    return results



def check_serves_adapter(client, url: str, rank: int) -> None:
    """vllm_push: adapter, at launch: the server serves LoRA adapters (--enable-lora) of this
    rank (its --max-lora-rank), on one data-parallel replica (an adapter loaded through one
    reaches only it), as its /server_info says (VLLM_SERVER_DEV_MODE=1; a server without it is
    not checked here: its first adapter load says what is missing)."""
    try:
        info = client.get_server_info()
    except Exception:
        return
    lora = info.get("lora_config")
    if lora is None:
        raise VLLMServerError(
            f"vllm_push is 'adapter' but the vLLM server at {url} serves no LoRA adapters: "
            f"restart it with --enable-lora --max-lora-rank {rank} (or larger) and "
            f"VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in its environment, or set vllm_push: merged")
    if lora.get("max_lora_rank", rank) < rank:
        raise ConfigError(
            f"'lora_r' is {rank} (the adapter's largest rank) but the vLLM server at {url} runs "
            f"with --max-lora-rank {lora['max_lora_rank']}: restart it with --max-lora-rank >= "
            f"{rank}, lower lora_r to <= {lora['max_lora_rank']}, or set vllm_push: merged")
    replicas = (info.get("parallel_config") or {}).get("data_parallel_size", 1)
    if replicas > 1:
        raise VLLMServerError(
            f"vllm_push is 'adapter' but the vLLM server at {url} runs {replicas} data-parallel "
            f"replicas, and an adapter loaded through it reaches only one: serve it with "
            f"--data-parallel-size 1, or set vllm_push: merged")


def adapter_sink(policy, servers: list, weights_dir, *, timeout: float):
    """The ServerAdapterFiles sink for vllm_push: adapter on `servers` ((VLLMClient, url)
    pairs), after the launch checks: the policy's adapter is one vLLM serves
    (cppo.models.lora.check_adapter_model), and each server serves its rank
    (check_serves_adapter)."""
    from cppo.models.lora import adapter_rank, check_adapter_model
    from cppo.sampling.weight_sinks import ServerAdapterFiles
    check_adapter_model(policy)
    rank = adapter_rank(policy.peft_config[policy.active_adapters[0]])
    for client, url in servers:
        check_serves_adapter(client, url, rank)
    return ServerAdapterFiles(servers, weights_dir, timeout=timeout)
