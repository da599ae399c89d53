"""Generation backends: where the G completions of each question come from.

One small interface, `backend.generate(prompts, round_index, question_offset) -> Completions`:

* `TransformersBackend` (default): the KV-shared sampler of cppo.rollout on the policy itself.
* `VLLMBackend` (`use_vllm: true`, `pip install 'cppo[vllm]'`): vLLM in the same process
  (`vllm_mode: colocate`) or a TRL `vllm-serve` server (`vllm_mode: server`). UNTESTED in this
  repository's CI (no vLLM, no GPU there); kept small so that it is easy to check by reading.

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

import hashlib
import os
from typing import Protocol

import torch

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


class VLLMBackend:
    """vLLM generation (UNTESTED here: needs a GPU and `pip install 'cppo[vllm]'`).

    colocate: a vllm.LLM in this process sharing the GPU (gpu_memory_utilization from
    CPPO_VLLM_GPU_MEMORY_UTILIZATION, default 0.3); the policy's weights are loaded into it before
    each round. server: a TRL `trl vllm-serve --model <same model>` server at
    CPPO_VLLM_SERVER_HOST:CPPO_VLLM_SERVER_PORT (default 127.0.0.1:8000), weights pushed through
    TRL's VLLMClient (needs `pip install trl`). Seeds follow `chunk_seed`, but vLLM's sampling is
    not bitwise reproducible across batch shapes, so 1 vs N process equality does not hold here.
    """

    def __init__(self, model, tokenizer, args) -> None:
        try:
            import vllm
        except ImportError as err:
            raise ImportError("use_vllm: true needs vLLM: pip install 'cppo[vllm]' "
                              f"(import failed: {err})") from err
        self.vllm, self.model, self.tokenizer, self.args = vllm, model, tokenizer, args
        self.synced_round: int | None = None
        if args.vllm_mode == "colocate":
            self.llm = vllm.LLM(
                model=model.config._name_or_path, dtype=args.torch_dtype if args.torch_dtype != "float32" else "auto",
                gpu_memory_utilization=float(os.environ.get("CPPO_VLLM_GPU_MEMORY_UTILIZATION", "0.3")),
                enable_prefix_caching=True, seed=args.seed,
                max_model_len=(args.max_prompt_length or 2048) + args.max_completion_length)
            self.client = None
        else:
            try:
                from trl.extras.vllm_client import VLLMClient
            except ImportError as err:
                raise ImportError("vllm_mode: server talks to `trl vllm-serve` through TRL's "
                                  f"VLLMClient: pip install trl (import failed: {err})") from err
            self.client = VLLMClient(host=os.environ.get("CPPO_VLLM_SERVER_HOST", "127.0.0.1"),
                                     server_port=int(os.environ.get("CPPO_VLLM_SERVER_PORT", "8000")))
            self.client.init_communicator()
            self.llm = None

    def _merged_state(self):
        model = self.model
        if hasattr(model, "merge_adapter"):  # LoRA: push base + adapters merged, then unmerge
            model.merge_adapter()
            try:
                state = {k.replace("base_model.model.", "").replace(".base_layer", ""): v
                         for k, v in model.state_dict().items() if "lora_" not in k}
            finally:
                model.unmerge_adapter()
            return state
        return model.state_dict()

    def _sync_weights(self, round_index: int) -> None:
        if self.synced_round == round_index:
            return
        state = self._merged_state()
        if self.llm is not None:
            runner = self.llm.llm_engine.model_executor.driver_worker.model_runner
            runner.model.load_weights(state.items())
            self.llm.reset_prefix_cache()
        else:
            for name, tensor in state.items():
                self.client.update_named_param(name, tensor)
            self.client.reset_prefix_cache()
        self.synced_round = round_index

    @torch.no_grad()
    def generate(self, prompts: PromptBatch, *, round_index: int, question_offset: int = 0) -> Completions:
        args, tok = self.args, self.tokenizer
        self._sync_weights(round_index)
        token_prompts = [row[mask.bool()].tolist() for row, mask in zip(prompts.ids.cpu(), prompts.mask.cpu())]
        num_generations = args.num_generations
        common = dict(temperature=args.temperature, top_p=args.top_p,
                      top_k=args.top_k if args.top_k > 0 else -1, max_tokens=args.max_completion_length)
        outputs: list[list[int]] = []
        if self.llm is not None:
            params = [self.vllm.SamplingParams(
                n=num_generations, seed=chunk_seed(args.seed, round_index, question_offset + i), **common)
                for i in range(len(token_prompts))]
            results = self.llm.generate([{"prompt_token_ids": p} for p in token_prompts], params,
                                        use_tqdm=False)
            for result in results:
                outputs += [list(o.token_ids) for o in result.outputs]
        else:
            result = self.client.generate(prompts=tok.batch_decode(token_prompts), n=num_generations,
                                          repetition_penalty=1.0, **common)
            outputs = result["completion_ids"] if isinstance(result, dict) else result
        return completions_from_token_lists(outputs, tok.eos_token_id, tok.pad_token_id,
                                            args.max_completion_length, device=prompts.ids.device)


def make_backend(model, tokenizer, args, chunk_size: int | None = None) -> GenerationBackend:
    """chunk_size: completions the built-in sampler decodes together (the trainer derives it
    from the memory budget); vLLM schedules its own batches."""
    if args.use_vllm:
        return VLLMBackend(model, tokenizer, args)
    return TransformersBackend(model, tokenizer, args, chunk_size)
