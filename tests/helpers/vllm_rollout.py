"""For test_vllm_engine.py: the arithmetic rows trained for 2 steps with a rollout_func that runs
a calculator between two turns a vLLM engine samples (the test module's, put in as the trainer's
backend). Every rollout compares vLLM's log-probs of its tokens with the policy's at that moment
(the weights must have been pushed before the call). Returns the differences, the tool calls and
the losses."""

from __future__ import annotations

import json

import torch


def train_with_vllm_rollouts(model, tokenizer, backend, output_dir: str) -> dict:
    from vllm import SamplingParams

    from cppo.config import CPPOConfig
    from cppo.sampling.logprobs import completion_logprobs
    from cppo.sampling.sampler import encode_prompts
    from cppo.trainer import CPPOTrainer
    report = {"differences": [], "tool_calls": 0}

    def vllm_turns(trainer, contexts, max_tokens):
        params = [SamplingParams(n=1, max_tokens=max_tokens, logprobs=0, seed=1000 * trainer.run_state.step + i,
                                 stop_token_ids=[trainer.tokenizer.eos_token_id], detokenize=False)
                  for i in range(len(contexts))]   # one seed per completion: the G differ
        outs = trainer.backend.llm.generate([{"prompt_token_ids": c} for c in contexts], params,
                                            use_tqdm=False)
        return [(list(o.outputs[0].token_ids),
                 [float(step[t].logprob) for t, step in zip(o.outputs[0].token_ids,
                                                            o.outputs[0].logprobs)]) for o in outs]

    def rollout(prompts, trainer):
        tok = trainer.tokenizer
        batch = encode_prompts(tok, prompts)
        prompt_ids = [row[m.bool()].tolist() for row, m in zip(batch.ids, batch.mask)]
        first = vllm_turns(trainer, prompt_ids, 2)
        completions, logprobs, env_mask, contexts, later = [], [], [], [], []
        for i, (turn, lps) in enumerate(first):
            tool = []
            if turn and turn[-1] != tok.eos_token_id:   # the calculator answers
                a, b = prompts[i].rstrip("=").split("*")
                tool = tok(f"{int(a) * int(b)};", add_special_tokens=False)["input_ids"]
                contexts.append(prompt_ids[i] + turn + tool)
                later.append(i)
            completions.append(turn + tool)
            logprobs.append(lps + [0.0] * len(tool))
            env_mask.append([1] * len(turn) + [0] * len(tool))
        report["tool_calls"] += len(later)
        for i, (turn, lps) in zip(later, vllm_turns(trainer, contexts, 3)):
            completions[i] += turn
            logprobs[i] += lps
            env_mask[i] += [1] * len(turn)
        # vLLM's log-probs of the model's tokens against the policy's, now
        from cppo.sampling.padding import pad_token_lists
        ids, mask = pad_token_lists(completions, tok.pad_token_id, side="right", min_width=1)
        p_ids, p_mask = pad_token_lists(prompt_ids, tok.pad_token_id, side="left")
        with torch.no_grad():
            ours = completion_logprobs(trainer.policy, p_ids, p_mask, ids, mask)
        model = pad_token_lists(env_mask, 0, side="right", min_width=ids.shape[1])[0].bool()
        theirs = torch.zeros_like(ours)
        for i, lps in enumerate(logprobs):
            theirs[i, :len(lps)] = torch.tensor(lps)
        report["differences"].append(float((ours - theirs).abs()[model & mask.bool()].max()))
        return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": logprobs,
                "env_mask": env_mask}

    from helpers import ROWS
    args = CPPOConfig(output_dir=output_dir, max_steps=2, eval_num_questions=4, num_generations=8,
                      per_device_train_batch_size=16, progress_bar=False, learning_rate=1e-2,
                      lr_scheduler_type="constant", save_steps=0, eval_steps=0)
    def digit_parity(completions, **kw):   # varied rewards, so that both steps train
        return [float(sum(map(ord, c)) % 2) for c in completions]
    trainer = CPPOTrainer(model=model, processing_class=tokenizer, args=args,
                          reward_funcs=[digit_parity], rollout_func=rollout, train_dataset=ROWS,
                          eval_dataset=ROWS[:4])
    trainer.backend = backend   # the engine the test module started, on this very model
    trainer.train()
    rows = [json.loads(line) for line in open(f"{output_dir}/metrics.jsonl")]
    report["losses"] = [r["loss"] for r in rows if "loss" in r]
    return report
