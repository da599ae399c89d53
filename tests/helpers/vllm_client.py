"""A stand-in for TRL's VLLMClient that takes the real call signatures (tests/test_vllm_backend.py,
tests/test_async_server_push.py, tests/test_cuda.py)."""

from __future__ import annotations

import inspect


class FakeClient:
    """TRL 1.16's VLLMClient surface, each call bound to the real method's signature: records the
    weight push (announced metadata, then the streamed tensors) and answers generate with fixed
    completions in the client's return format (logprobs (N, T, 1))."""

    def __init__(self, logprobs_mode="processed_logprobs", base_url="http://fake:8000"):
        from trl.generation.vllm_client import VLLMClient
        self.real, self.calls, self.streamed, self.asked = VLLMClient, [], [], {}
        self.logprobs_mode, self.base_url = logprobs_mode, base_url

    def _bind(self, method, *args, **kwargs):
        inspect.signature(getattr(self.real, method)).bind(self, *args, **kwargs)
        self.calls.append(method)

    def init_communicator(self, device=0):
        self._bind("init_communicator", device=device)

    def get_server_info(self):
        self._bind("get_server_info")
        return {"model_config": {"logprobs_mode": self.logprobs_mode}}

    def update_named_params(self, metadata, named_params):
        self._bind("update_named_params", metadata, named_params)
        self.metadata = metadata
        self.streamed = [(name, tensor.clone()) for name, tensor in named_params]

    def reset_prefix_cache(self):
        self._bind("reset_prefix_cache")

    def generate(self, prompts, **kw):
        self._bind("generate", prompts, **kw)
        self.asked = dict(kw, prompts=prompts)
        return {"prompt_ids": prompts, "completion_ids": [[5, 2], [6, 7, 2]] * len(prompts),
                "logprobs": [[[-0.5], [-0.25]], [[-1.0], [None], [-3.0]]] * len(prompts),
                "logprob_token_ids": [[[5], [2]], [[6], [7], [2]]] * len(prompts)}
