"""The vLLM server's address and connection (`vllm_mode: server`): TRL's VLLMClient on a `trl
vllm-serve` server (or vLLM's server with TRL's flags), as the config's vLLM section names it;
for adapter pushes (vllm_push: adapter) the server's LoRA limits checked and the sink built."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cppo.errors import ConfigError, VLLMServerError, VLLMUnavailableError

if TYPE_CHECKING:
    from cppo.config.sections import VLLMSection


def server_url(vllm: VLLMSection) -> str:
    """The server's address from the config's vLLM section."""
    return vllm.vllm_server_base_url or f"http://{vllm.vllm_server_host}:{vllm.vllm_server_port}"


def connect_server(vllm: VLLMSection):
    """TRL's VLLMClient on the server the vLLM section names (`trl vllm-serve`, or
    vLLM's server with TRL's flags); a server that does not answer within vllm_server_timeout
    seconds is a VLLMServerError naming the address and the fields that set it."""
    try:
        from trl.generation.vllm_client import VLLMClient
    except ImportError as err:
        raise VLLMUnavailableError("vllm_mode: server talks to `trl vllm-serve` through TRL's "
                                   f"VLLMClient: pip install trl (import failed: {err})") from err
    url = server_url(vllm)
    try:
        return VLLMClient(base_url=url, group_port=vllm.vllm_group_port,
                          connection_timeout=vllm.vllm_server_timeout)
    except (ConnectionError, OSError) as err:
        raise VLLMServerError(
            f"vllm_mode: server: no vLLM server answered at {url} within vllm_server_timeout = "
            f"{vllm.vllm_server_timeout} s: start one (`trl vllm-serve --model <the model>`), or "
            f"point vllm_server_base_url (or vllm_server_host / vllm_server_port) at it "
            f"({type(err).__name__}: {err})") from err



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
