"""What the tool-calling tests share (test_multi_turn.py on cppo's sampler, test_vllm_engine.py on
vLLM): a tiny Qwen2 whose chat template renders tools, tool calls and tool results, a multiply
tool and a calculator environment, the arithmetic chat rows, and a first model turn written for a
random model (which calls no tool by itself)."""

from __future__ import annotations

import os

import torch

from cppo.sampling.tools import ToolLoop

TOOL_LOG = "CPPO_TEST_TOOL_LOG"   # when set: a file each multiply call adds its process id to

TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{{ {'name': c.function.name, "
    "'arguments': c.function.arguments} | tojson }}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tool_rows() -> list[dict]:
    """4 chat questions (a fresh copy each call: a run may change its rows)."""
    return [{"prompt": [{"role": "user", "content": f"{a}*{b}="}], "answer": str(a * b)}
            for a, b in [(12, 34), (5, 6), (7, 8), (21, 3)]]


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    if os.environ.get(TOOL_LOG):
        with open(os.environ[TOOL_LOG], "a") as log:
            log.write(f"{os.getpid()}\n")
    return a * b


class CalculatorEnv:
    """TRL's environment contract: reset per rollout, public methods as tools, get_reward."""

    def __init__(self):
        self.answer, self.result = None, None

    def reset(self, **row):
        self.answer, self.result = row.get("answer"), None
        return " (a calculator is available)"

    def multiply(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: The first factor.
            b: The second factor.
        """
        self.result = a * b
        return self.result

    def get_reward(self) -> float:
        return 1.0 if str(self.result) == self.answer else 0.0


def save_tool_model(path, **sizes) -> str:
    """A tiny Qwen2 with a byte-level tokenizer and TOOL_TEMPLATE, saved as a model directory
    (sizes: config fields to change, see helpers.tiny_hf.build_model)."""
    from helpers.tiny_hf import build_model, build_tokenizer
    tok = build_tokenizer("qwen2")
    tok.chat_template = TOOL_TEMPLATE
    build_model("qwen2", tok, **sizes).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def write_call(tok, context: list[int]) -> list[int]:
    """A model turn calling multiply with the question's numbers (context: the rendered prompt)."""
    a, b = tok.decode(context).split("user\n")[-1].split("=")[0].split("*")
    call = f'<tool_call>\n{{"name": "multiply", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'
    return tok(call, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


class ScriptedToolLoop(ToolLoop):
    """script_first_turn for a loop that runs elsewhere (async_rollout's generator gets a pickled
    copy): the first turn of every other completion of every round is written (a multiply
    call); where the sampler returns log-probs, a written turn gets the policy's own."""

    def sample(self, run, contexts, num_generations, max_new_tokens, turn=0, keys=None):
        turns, logprobs = super().sample(run, contexts, num_generations, max_new_tokens, turn, keys)
        if turn:
            return turns, logprobs
        for i in range(0, len(turns), 2):
            context = contexts[i // num_generations]
            turns[i] = write_call(run.tokenizer, context)
            if logprobs is not None:
                logprobs[i] = policy_logprobs(run, context, turns[i])
        return turns, logprobs


def script_tool_turns(trainer) -> None:
    """The trainer's tool loop becomes a ScriptedToolLoop (a picklable class)."""
    trainer.rollout_func.__class__ = ScriptedToolLoop


def script_first_turn(trainer) -> list[int]:
    """A random model does not call tools: the first turn of every other completion is written
    for it (a multiply call with the question's numbers); every later turn is sampled. Where the
    sampler returns log-probs (vLLM), a written turn gets the policy's own. Returns the number of
    contexts of each sampling call, as they come."""
    loop, tok = trainer.rollout_func, trainer.tokenizer
    sample, calls = loop.sample, []

    def scripted(run, contexts, num_generations, max_new_tokens, **kw):   # run: a ToolContext
        calls.append(len(contexts))
        turns, logprobs = sample(run, contexts, num_generations, max_new_tokens, **kw)
        if len(calls) > 1:
            return turns, logprobs
        for i in range(0, len(turns), 2):
            context = contexts[i // num_generations]
            a, b = tok.decode(context).split("user\n")[-1].split("=")[0].split("*")
            call = f'<tool_call>\n{{"name": "multiply", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'
            turns[i] = tok(call, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            if logprobs is not None:
                logprobs[i] = policy_logprobs(run, context, turns[i])
        return turns, logprobs
    loop.sample = scripted
    return calls


def policy_logprobs(run, context: list[int], turn: list[int]) -> list[float]:
    """The policy's log-prob of each token of `turn` after `context`, at the run's temperature
    (run: the tool loop's ToolContext)."""
    from cppo.sampling.logprobs import completion_logprobs
    prompt, ids = torch.tensor([context]), torch.tensor([turn])
    with torch.no_grad():
        return completion_logprobs(run.policy, prompt, torch.ones_like(prompt), ids,
                                   torch.ones_like(ids), temperature=run.sampling.temperature)[0].tolist()
