"""Generation backends: where the G completions of each question come from.

One small interface, `backend.generate(prompts, round_index, question_offset) -> Completions`:

* `TransformersBackend` (default): the KV-shared sampler of cppo.rollout on the policy itself.
* `VLLMBackend` (`use_vllm: true`, `pip install 'cppo[vllm]'`): vLLM in the same process
  (`vllm_mode: colocate`) or a TRL `vllm-serve` server (`vllm_mode: server`). Never run against
  a real engine in this repository's tests (no vLLM, no GPU there): its weight-name mapping,
  request arguments and log-prob plumbing are tested with a fake engine.

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

from cppo.config import VLLMUnavailableError
from cppo.models.lean import lean_forward_for
from cppo.padding import pad_token_lists
from cppo.rollout import Completions, PromptBatch, concat_completions, sample_completions


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
                    top_k=args.top_k, generator=generator, lean=args.lean_forward,
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


@contextlib.contextmanager
def vllm_weights(model):
    """(vLLM name, tensor) of every weight, LoRA adapters merged in for the duration (the tensors
    are the live parameters: push them before the context exits)."""
    merge = hasattr(model, "merge_adapter")
    if merge:
        model.merge_adapter()
    try:
        named = ((vllm_weight_name(n), p.detach()) for n, p in model.named_parameters())
        yield [(n, t) for n, t in named if n is not None]
    finally:
        if merge:
            model.unmerge_adapter()


def sampling_kwargs(args) -> dict:
    """vLLM SamplingParams (and TRL server) arguments for one prompt's G completions. logprobs=0
    returns the sampled token's log-prob (after temperature/top-k/top-p: the engine runs with
    logprobs_mode='processed_logprobs'), which the importance-sampling correction needs."""
    return dict(n=args.num_generations, temperature=args.temperature, top_p=args.top_p,
                top_k=args.top_k, max_tokens=args.max_completion_length,
                logprobs=0 if args.importance_sampling_correction else None)


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


class VLLMBackend:
    """vLLM generation (`pip install 'cppo[vllm]'`, vLLM >= 0.22). Not run in this repository's
    tests (they have no GPU); its pure parts (weight names, request arguments, log-prob plumbing)
    are tested with a fake engine.

    colocate: a `vllm.LLM` in this process sharing the GPU (`vllm_gpu_memory_utilization`),
    running in-process (`distributed_executor_backend='external_launcher'`, one engine per
    training process). Each round the policy's weights are written into the engine's model in
    place (`LLM.apply_model(lambda m: m.load_weights(...))`) and the prefix cache is reset. With
    `vllm_enable_sleep_mode` the engine sleeps (level 2: weights and KV cache released) between
    rounds and wakes its weights, then its KV cache, for the next.
    server: a TRL `trl vllm-serve --model <same model>` server at
    CPPO_VLLM_SERVER_HOST:CPPO_VLLM_SERVER_PORT (default 127.0.0.1:8000); weights are pushed
    through TRL's VLLMClient (`pip install trl`). Both return each token's sampler log-prob, so the
    importance-sampling correction applies. Seeds follow `chunk_seed` per question in colocate
    mode, but vLLM's sampling is not bitwise reproducible across batch shapes.
    """

    def __init__(self, model, tokenizer, args, vllm=None, client=None) -> None:
        if vllm is None and client is None:
            vllm = import_vllm()
        self.vllm, self.model, self.tokenizer, self.args = vllm, model, tokenizer, args
        self.synced_round: int | None = None
        self.sleeping = False
        self.llm, self.client = None, client
        if args.vllm_mode == "colocate" and client is None:
            self.llm = vllm.LLM(**self.engine_kwargs())
            if args.vllm_enable_sleep_mode:
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

    def engine_kwargs(self) -> dict:
        args = self.args
        return dict(model=self.model.config._name_or_path,
                    dtype=args.torch_dtype if args.torch_dtype != "float32" else "auto",
                    gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                    enable_sleep_mode=args.vllm_enable_sleep_mode, enable_prefix_caching=True,
                    seed=args.seed, distributed_executor_backend="external_launcher",
                    logprobs_mode="processed_logprobs",
                    max_model_len=(args.max_prompt_length or 2048) + args.max_completion_length)

    def _sync_weights(self, round_index: int) -> None:
        """Write the policy's current weights into the engine, once per round, in place."""
        if self.synced_round == round_index:
            return
        if self.llm is not None:
            if self.sleeping:
                self.llm.wake_up(tags=["weights"])
            with vllm_weights(self.model) as weights:
                self.llm.apply_model(lambda model: model.load_weights(weights))
            self.llm.reset_prefix_cache()
        else:
            with vllm_weights(self.model) as weights:
                for name, tensor in weights:
                    self.client.update_named_param(name, tensor)
            self.client.reset_prefix_cache()
        self.synced_round = round_index

    def requests(self, prompts: PromptBatch, round_index: int, question_offset: int):
        """(prompt token lists, one SamplingParams per prompt seeded by chunk_seed)."""
        token_prompts = [row[mask.bool()].tolist()
                         for row, mask in zip(prompts.ids.cpu(), prompts.mask.cpu())]
        if self.llm is None:   # server mode: the server seeds its own sampling
            return token_prompts, None
        common = sampling_kwargs(self.args)
        params = [self.vllm.SamplingParams(
            seed=chunk_seed(self.args.seed, round_index, question_offset + i), **common)
            for i in range(len(token_prompts))]
        return token_prompts, params

    @torch.no_grad()
    def generate(self, prompts: PromptBatch, *, round_index: int, question_offset: int = 0) -> Completions:
        args, tok = self.args, self.tokenizer
        self._sync_weights(round_index)
        token_prompts, params = self.requests(prompts, round_index, question_offset)
        outputs: list[list[int]] = []
        logprobs: list[list[float]] | None = [] if args.importance_sampling_correction else None
        if self.llm is not None:
            if self.sleeping:
                self.llm.wake_up(tags=["kv_cache"])
            results = self.llm.generate([{"prompt_token_ids": p} for p in token_prompts], params,
                                        use_tqdm=False)
            for result in results:
                for o in result.outputs:
                    outputs.append(list(o.token_ids))
                    if logprobs is not None:
                        logprobs.append(sampled_logprobs(o.token_ids, o.logprobs))
            if self.args.vllm_enable_sleep_mode:
                self.llm.sleep(level=2)
                self.sleeping = True
        else:
            common = sampling_kwargs(args)
            result = self.client.generate(prompts=token_prompts, **common)
            outputs = result["completion_ids"]
            if logprobs is not None:   # (N, T, 1) with logprobs=0: the sampled token's
                logprobs = [[step[0] for step in seq] for seq in result["logprobs"]]
        return completions_with_logprobs(outputs, logprobs, tok.eos_token_id, tok.pad_token_id,
                                         args.max_completion_length, device=prompts.ids.device)


def import_vllm():
    """The vllm module, or an error naming the extra to install."""
    try:
        import vllm
    except ImportError as err:
        raise VLLMUnavailableError(f"'use_vllm' is true but vLLM cannot be imported: "
                                   f"pip install 'cppo[vllm]' (import failed: {err})") from err
    return vllm


def make_backend(model, tokenizer, args, chunk_size: int | None = None) -> GenerationBackend:
    """chunk_size: completions the built-in sampler decodes together (the trainer derives it
    from the memory budget); vLLM schedules its own batches."""
    if args.use_vllm:
        return VLLMBackend(model, tokenizer, args)
    return TransformersBackend(model, tokenizer, args, chunk_size)
