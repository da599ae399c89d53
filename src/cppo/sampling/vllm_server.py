"""The vLLM server's address and connection (`vllm_mode: server`): TRL's VLLMClient on a `trl
vllm-serve` server (or vLLM's server with TRL's flags), as the config's vLLM section names it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cppo.errors import VLLMServerError, VLLMUnavailableError

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

