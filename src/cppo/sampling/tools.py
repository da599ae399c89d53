"""Tool calls as TRL 1.16's GRPOTrainer runs them (`tools=[...]`, `max_tool_calling_iterations`).

For conversational prompts: each prompt is rendered with the tools' schemas by the tokenizer's
chat template, the model writes a turn, and every turn that calls tools gets the tools' results
appended as tool messages (their tokens rendered by the chat template, as TRL's
`_get_tool_suffix_ids` does) and one more model turn, until no turn calls a tool,
`max_tool_calling_iterations` rounds have run, or the completion would pass
`max_completion_length` (then the tool results of that round are dropped and the completion ends
as it is). The tool results' tokens are in the completion, hence in the context of every later
forward pass, and out of the loss (`env_mask` 0). The whole multi-turn completion is one
completion for rewards, advantages and pruning.

A turn's tool calls are read with the tokenizer's own parser (`tokenizer.parse_response`, when the
tokenizer carries a `response_template` or `response_schema`), else in the Hermes / Qwen format
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
"""

from __future__ import annotations

import inspect
import json
import re
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from cppo.errors import ConfigError
from cppo.sampling.padding import pad_token_lists
from cppo.sampling.batches import PromptBatch
from cppo.sampling.sampler import Decoding, chunk_seed, sample_completions
from cppo.sampling.settings import SamplingSettings

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolContext:
    """What the tool loop reads of a run, for one round: the tokenizer, the policy (cppo's
    sampler draws the turns on it), the generation backend (vLLM samples token contexts:
    `sample_contexts`, `max_model_len`), the sampling settings, the config's lengths and seed,
    this process's rank, the round and the optimizer step."""

    tokenizer: object
    policy: object
    backend: object
    device: torch.device
    sampling: SamplingSettings
    seed: int
    num_generations: int
    max_prompt_length: int | None
    max_completion_length: int
    lean_forward: bool
    share_prefixes: bool
    rank: int
    round_index: int
    step: int


def parse_tool_calls(tokenizer, ids: list[int], prefix: list[int] | None = None,
                     tools: Sequence[Callable] | None = None) -> list[dict]:
    """The tool calls of one model turn (token ids), as chat messages' `tool_calls` entries
    ({"type": "function", "function": {"name", "arguments"}}); [] when it calls none. A call that
    does not parse is not a call (TRL falls back to plain text too)."""
    if getattr(tokenizer, "response_template", None) is not None or \
            getattr(tokenizer, "response_schema", None) is not None:
        try:
            parsed = tokenizer.parse_response(ids, prefix=prefix, tools=list(tools or []) or None)
        except Exception:   # noqa: BLE001 -- malformed output is plain text, as in TRL
            return []
        return [c for c in parsed.get("tool_calls") or [] if _is_call(c)]
    text = tokenizer.decode(ids, skip_special_tokens=False)
    calls = []
    for body in TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            continue
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            arguments = call.get("arguments", {})
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except json.JSONDecodeError:
                    continue
            if isinstance(arguments, dict):
                calls.append({"type": "function",
                              "function": {"name": call["name"], "arguments": arguments}})
    return calls


def _is_call(call) -> bool:
    return isinstance(call, dict) and isinstance(call.get("function"), dict) and \
        isinstance(call["function"].get("name"), str)


def run_tool_calls(calls: list[dict], tools: dict[str, Callable]) -> tuple[list[dict], int]:
    """Run each call; returns the tool messages ({"role": "tool", "name", "content"}) and the number
    that failed (unknown tool, bad arguments, an exception: the message says so, as in TRL)."""
    messages, failures = [], 0
    for call in calls:
        name = call.get("function", {}).get("name", "unknown")
        try:
            if call.get("type") != "function":
                raise ValueError(f"Unsupported tool call type: {call.get('type')}")
            if name not in tools:
                raise ValueError(f"Tool {name} not found.")
            result = tools[name](**call["function"].get("arguments", {}))
        except Exception as err:   # noqa: BLE001 -- the model sees the error, as in TRL
            failures += 1
            result = {"error": str(err)}
        messages.append({"role": "tool", "name": name, "content": str(result)})
    return messages, failures


def tool_suffix_ids(tokenizer, tool_messages: list[dict]) -> list[int]:
    """The tokens the chat template puts after an assistant turn for these tool messages, up to
    and including the next assistant header (TRL's `_get_tool_suffix_ids`: a dummy
    conversation rendered with and without them, cut after the assistant turn's EOS)."""
    calls = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
    dummy = [{"role": "user", "content": "dummy"},
             {"role": "assistant", "content": "", "tool_calls": calls}]
    prefix = tokenizer.apply_chat_template(dummy, add_generation_prompt=False, tokenize=True,
                                           return_dict=False)
    full = tokenizer.apply_chat_template(dummy + tool_messages, add_generation_prompt=True,
                                         tokenize=True, return_dict=False)
    eos = [i for i, t in enumerate(prefix) if t == tokenizer.eos_token_id]
    if eos:
        prefix = prefix[:eos[-1] + 1]
    if full[:len(prefix)] != prefix:
        raise ValueError("the chat template is not prefix-preserving (an assistant turn renders "
                         "differently once tool messages follow it): tool calling needs one that is")
    return full[len(prefix):]


def check_tools(tools) -> list[Callable]:
    """TRL's `tools`: plain functions (their names, type hints and docstrings become the schema the
    chat template renders); async ones are not supported here."""
    tools = list(tools)
    for tool in tools:
        if not callable(tool) or not hasattr(tool, "__name__"):
            raise ValueError(f"tools: {tool!r} is not a function")
        if inspect.iscoroutinefunction(tool):
            raise ValueError(f"tools: {tool.__name__} is async; cppo runs synchronous tools only")
    names = [t.__name__ for t in tools]
    if len(set(names)) != len(names):
        raise ValueError(f"tools: two tools share a name ({sorted(names)})")
    return tools


class ToolLoop:
    """A rollout function (cppo.sampling.multi_turn's contract) that samples the model's turns
    and runs tools between them. `sample(run, contexts, num_generations, max_new_tokens, ...)`
    draws the turns: contexts are token-id lists, the result one token-id list per completion
    (context-major) and the sampler's log-probs of their tokens. With a backend that samples token
    contexts (vLLM: `sample_contexts`) the turns are vLLM's, each with its own token budget, and
    the rollout returns vLLM's log-probs of the model's tokens (0 on a tool's, which are out of
    the loss and of the importance-sampling correction); else cppo's sampler draws them on the
    policy and the rollout has no sampler log-probs (except under async_rollout with
    max_staleness > 0, whose generator's backend records the behaviour log-probs).

    environment_factory (TRL's): each rollout gets its own instance (created once, reused across
    steps), `reset(**row)` before its first turn (a returned string is appended to the last user
    message), and the instance's public methods as tools besides `tools`; an instance's
    `get_reward()` scores its rollout (`env_rewards`: one reward function per environment class,
    named after it, weight 1). A dict of factories: each row's `environment` column picks one.
    Reward functions get the instances as `environments`."""

    def __init__(self, tools: Sequence[Callable], max_iterations: int | None = None,
                 environment_factory: Callable | dict[str, Callable] | None = None) -> None:
        self.tools = check_tools(tools)
        self.by_name = {t.__name__: t for t in self.tools}
        self.max_iterations = max_iterations
        self.metrics: dict[str, float] = {}
        self.messages: list[list[dict]] = []   # the last rollouts as chat messages (for rewards)
        self.multi = isinstance(environment_factory, dict)
        self.factories = environment_factory if self.multi else \
            ({} if environment_factory is None else {None: environment_factory})
        self.pools: dict = {}          # environment name -> its instances, reused across steps
        self.env_methods: dict = {}    # environment name -> the method names served as tools
        self.env_rewards: list[Callable] = []
        for name, factory in self.factories.items():
            if not callable(factory):
                raise ValueError(f"environment_factory[{name!r}] is {factory!r}; expected a callable "
                                 f"that returns an environment")
            self._probe(name, factory)

    def __getstate__(self) -> dict:
        """What a copy for async_rollout's generator carries (pickled to cppo's generator process,
        deep-copied for a vLLM server's thread): the tools, the environments' factories and
        instances; not the environment reward functions (the trainer's) nor the last rollouts."""
        return {**self.__dict__, "env_rewards": [], "messages": [], "metrics": {}}

    @property
    def factory(self):
        return self.factories or None

    def _probe(self, name, factory: Callable) -> None:
        """TRL's checks on one instance: a `reset`; its public methods become tools; a
        `get_reward` makes its class a reward source (once per class)."""
        instance = factory()
        names = [n for n, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)]
        if "reset" not in names:
            raise ValueError("environment_factory: each environment must define a callable `reset` "
                             "(TRL's contract)")
        methods = [n for n in names if n not in ("reset", "get_reward") and not n.startswith("_")]
        clash = set(methods) & set(self.by_name)
        if clash:
            raise ValueError(f"environment_factory: methods {sorted(clash)} share a name with tools")
        self.env_methods[name], self.pools[name] = methods, [instance]
        env_type = type(instance)
        if "get_reward" in names and all(f.env_type is not env_type for f in self.env_rewards):
            def env_reward(completions, environments=None, **kw):
                if environments is None:   # scored before training (no rollout yet): no opinion
                    return [None] * len(completions)
                return [e.get_reward() if type(e) is env_type else None for e in environments]
            env_reward.__name__, env_reward.env_type = env_type.__name__, env_type
            self.env_rewards.append(env_reward)

    def environments(self, rows: list[dict]) -> tuple[list, list]:
        """One instance per rollout (rows: each rollout's row) and its environment's name."""
        names = [row.get("environment") if self.multi else None for row in rows]
        for name in set(names) - set(self.factories):
            raise ValueError(f"a row has environment={name!r}, which is not among the environments "
                             f"passed to environment_factory: {sorted(map(str, self.factories))}")
        cursor: dict = {}
        out = []
        for name in names:
            index = cursor.get(name, 0)
            pool = self.pools[name]
            if index == len(pool):
                pool.append(self.factories[name]())
            cursor[name] = index + 1
            out.append(pool[index])
        return out, names

    @staticmethod
    def assistant_message(tokenizer, turn: list[int], calls: list[dict]) -> dict:
        """A model turn as TRL hands it to reward functions: its text, and its tool calls."""
        text = tokenizer.decode(turn, skip_special_tokens=True)
        if calls:
            text = TOOL_CALL.sub("", text).strip()
            return {"role": "assistant", "content": text, "tool_calls": calls}
        return {"role": "assistant", "content": text}

    def sample(self, run: ToolContext, contexts: list[list[int]], num_generations: int,
               max_new_tokens: list[int] | int, turn: int = 0, keys: list[int] | None = None
               ) -> tuple[list[list[int]], list[list[float]] | None]:
        """num_generations turns after each context (rows context-major), at most max_new_tokens
        tokens (one budget, or one per context), and the sampler's log-probs of their tokens
        (None: cppo's sampler, the policy itself). vLLM seeds context c of model turn `turn` with
        chunk_seed(seed, round, keys[c], turn): keys are the contexts' places among all
        processes' (their questions for the first turn of shared prompts, seeded as single-turn
        generation; else their rollouts), so the seeds do not depend on the process count."""
        tok = run.tokenizer
        budgets = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(contexts)
        sample_contexts = getattr(run.backend, "sample_contexts", None)
        if sample_contexts is not None:
            seeds = [chunk_seed(run.seed, run.round_index, key, turn)
                     for key in (range(len(contexts)) if keys is None else keys)]
            return sample_contexts(contexts, num_generations=num_generations, max_tokens=budgets,
                                   seeds=seeds, round_index=run.round_index)
        prompts = PromptBatch(*pad_token_lists(contexts, tok.pad_token_id, side="left"))
        generator = torch.Generator(device=run.device).manual_seed(
            (run.seed * 1_000_003 + run.step * 7919 + len(contexts)) % 2**63)
        record = getattr(run.backend, "record_logprobs", False)   # async_rollout, max_staleness > 0
        with torch.no_grad():
            out = sample_completions(
                run.policy, prompts.to(run.device), num_generations=num_generations,
                max_new_tokens=max(budgets), eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id, sampling=run.sampling, generator=generator,
                decoding=Decoding(lean=run.lean_forward, share_prefixes=run.share_prefixes,
                                  record_logprobs=record))
        masks = [mask.bool() for mask in out.mask.cpu()]
        turns = [ids[mask].tolist() for ids, mask in zip(out.ids.cpu(), masks)]
        logprobs = [lp[mask].tolist() for lp, mask in zip(out.logprobs.cpu(), masks)] \
            if record and out.logprobs is not None else None
        if isinstance(max_new_tokens, list):
            turns = [t[:n] for t, n in zip(turns, max_new_tokens)]
            logprobs = None if logprobs is None else \
                [lp[:n] for lp, n in zip(logprobs, max_new_tokens)]
        return turns, logprobs

    @staticmethod
    def context_limit(run: ToolContext) -> int:
        """Tokens a context may hold: the policy's positions, and vLLM's max_model_len (TRL)."""
        limits = [getattr(run.policy.config, "max_position_embeddings", None),
                  getattr(run.backend, "max_model_len", None)]
        return min([n for n in limits if n] or [1 << 30])

    def __call__(self, prompts: list, run: ToolContext, rows: list[dict] | None = None) -> dict:
        """Roll out each prompt (num_generations copies of each question's, question-major) with
        tool calls; rows: each prompt's dataset row (environments are reset with it)."""
        if not all(isinstance(p, list) for p in prompts):
            raise ValueError("tools need conversational prompts (lists of chat messages), as in TRL")
        prompts, tools, environments = self._prepared(prompts, rows)
        g = run.num_generations
        shared = environments is None   # G completions of a question share its prompt
        rendered = self._render(run, prompts[::g], tools[::g]) if shared else \
            self._render(run, prompts, tools)
        first = run.rank * len(rendered)   # this process's first question (or rollout)
        completions, logprobs = self.sample(run, rendered, g if shared else 1,
                                            run.max_completion_length,
                                            keys=list(range(first, first + len(rendered))))
        prompt_ids = [ids for ids in rendered for _ in range(g)] if shared else rendered
        tok = run.tokenizer
        calls = [parse_tool_calls(tok, c, prompt_ids[i], tools[i]) for i, c in enumerate(completions)]
        r = _Rollouts(prompt_ids, completions, logprobs, [[1] * len(c) for c in completions], calls,
                      [[self.assistant_message(tok, c, calls[i])] for i, c in enumerate(completions)])
        count, failures = self._run_turns(run, r, tools)
        self.messages = r.messages
        self.metrics = {"tools/call_frequency": count / max(len(completions), 1),
                        "tools/failure_frequency": failures / count if count else 0.0}
        out = {"prompt_ids": prompt_ids, "completion_ids": r.completions, "logprobs": r.logprobs,
               "env_mask": r.env_mask}
        if environments is not None:
            out["environments"] = list(environments)   # a reward column, as TRL passes them
        return out

    def _prepared(self, prompts: list, rows: list[dict] | None) -> tuple[list, list, list | None]:
        """The prompts (reset environments may add to them), each one's tools, and its
        environment instance (None without environment_factory)."""
        tools = [self.tools] * len(prompts)
        if not self.factories:
            return prompts, tools, None
        rows = rows or [{}] * len(prompts)   # one environment per rollout: prompts and tools differ
        environments, names = self.environments(rows)
        prompts = [self._reset(env, p, {k: v for k, v in row.items()
                                        if not (self.multi and k == "environment")})
                   for env, p, row in zip(environments, prompts, rows)]
        tools = [self.tools + [getattr(env, n) for n in self.env_methods[name]]
                 for env, name in zip(environments, names)]
        return prompts, tools, environments

    @staticmethod
    def _render(run: ToolContext, prompts: list, tools: list) -> list[list[int]]:
        """Each prompt with its tools' schemas through the chat template, cut to max_prompt_length."""
        rendered = [run.tokenizer.apply_chat_template(p, tools=ts or None, add_generation_prompt=True,
                                                      tokenize=True, return_dict=False)
                    for p, ts in zip(prompts, tools)]
        if run.max_prompt_length is not None:
            rendered = [ids[-run.max_prompt_length:] for ids in rendered]
        return rendered

    def _run_turns(self, run: ToolContext, r: "_Rollouts", tools: list) -> tuple[int, int]:
        """Tool results and model turns until no turn calls a tool, max_iterations rounds have
        run or nothing fits any more; returns the tool calls made and how many failed."""
        by_name = [{t.__name__: t for t in ts} for ts in tools]
        pending = [i for i, c in enumerate(r.calls) if c]
        max_len = self.context_limit(run)
        count = failures = rounds = 0
        while pending and (self.max_iterations is None or rounds < self.max_iterations):
            contexts, budgets, ready, made, failed = self._append_results(run, r, pending, by_name,
                                                                          max_len)
            count, failures = count + made, failures + failed
            if not ready:
                break
            rounds += 1
            first = run.rank * len(r.completions)   # this process's first rollout
            turns, turn_logprobs = self.sample(run, contexts, 1, budgets, turn=rounds,
                                               keys=[first + i for i in ready])
            for k, (i, turn) in enumerate(zip(ready, turns)):
                r.completions[i] = r.completions[i] + turn
                r.env_mask[i] += [1] * len(turn)
                if r.logprobs is not None:
                    r.logprobs[i] += turn_logprobs[k]
                r.calls[i] = parse_tool_calls(run.tokenizer, turn, contexts[k], tools[i]) if turn else []
                if turn:
                    r.messages[i].append(self.assistant_message(run.tokenizer, turn, r.calls[i]))
            pending = [i for i in ready if r.calls[i]]
        return count, failures

    @staticmethod
    def _append_results(run: ToolContext, r: "_Rollouts", pending: list[int], by_name: list[dict],
                        max_len: int) -> tuple[list, list, list, int, int]:
        """Run the pending completions' tool calls and append their results where they fit; returns
        the contexts to continue, their token budgets, their completions' indices, and the calls
        made and failed."""
        limit = run.max_completion_length
        contexts, budgets, ready, count, failures = [], [], [], 0, 0
        for i in pending:
            results, failed = run_tool_calls(r.calls[i], by_name[i])
            count, failures = count + len(r.calls[i]), failures + failed
            suffix = tool_suffix_ids(run.tokenizer, results)
            grown = r.completions[i] + suffix
            if len(grown) > limit or len(r.prompt_ids[i]) + len(grown) >= max_len:
                continue   # the results would not fit: the completion ends as it is (TRL)
            contexts.append(r.prompt_ids[i] + grown)
            budgets.append(limit - len(grown))
            r.completions[i] = grown
            r.env_mask[i] += [0] * len(suffix)
            if r.logprobs is not None:   # a tool's tokens: no sampler log-prob
                r.logprobs[i] += [0.0] * len(suffix)
            r.messages[i] += results
            ready.append(i)
        return contexts, budgets, ready, count, failures

    @staticmethod
    def _reset(environment, prompt: list[dict], row: dict) -> list[dict]:
        """TRL: reset(**row); a string it returns is appended to the last message's content."""
        observation = environment.reset(**row)
        if observation is None:
            return prompt
        return prompt[:-1] + [{**prompt[-1], "content": prompt[-1]["content"] + str(observation)}]


@dataclass
class _Rollouts:
    """One call's rollouts as they grow (one entry per completion): the prompt's and the
    completion's token ids, the sampler's log-probs (None: cppo's sampler), env_mask (0 on a
    tool's tokens), the last turn's tool calls and the chat messages."""

    prompt_ids: list[list[int]]
    completions: list[list[int]]
    logprobs: list[list[float]] | None
    env_mask: list[list[int]]
    calls: list[list[dict]]
    messages: list[list[dict]]


def rollout_function(rollout_func, tools, environment_factory, max_iterations: int | None,
                     two_stage_generations: int = 0):
    """TRL's rollout_func, or cppo's tool loop for tools or an environment_factory (its turns
    are sampled by vLLM with use_vllm, else by cppo's sampler); None: one sampled turn per
    completion. Raises ConfigError for arguments TRL would refuse."""
    if environment_factory is not None and not callable(environment_factory) \
            and not isinstance(environment_factory, dict):
        raise ConfigError(f"environment_factory is {environment_factory!r}; expected a "
                          f"callable that returns an environment (TRL's environment_factory)")
    if rollout_func is not None and not callable(rollout_func):
        raise ConfigError(f"rollout_func is {rollout_func!r}; expected a function "
                          f"(prompts, trainer) -> dict (TRL's rollout_func)")
    if tools or environment_factory is not None:
        if rollout_func is not None:
            raise ConfigError("give tools (or environment_factory) or rollout_func, not both (a "
                              "rollout function runs its own tools)")
        try:
            rollout_func = ToolLoop(tools or [], max_iterations,
                                    environment_factory=environment_factory)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    if two_stage_generations and rollout_func is not None:
        raise ConfigError(f"'two_stage_generations' is {two_stage_generations}, which "
                          f"applies to the built-in sampler; a rollout_func, tools or an "
                          f"environment_factory roll out whole groups: set it to 0")
    return rollout_func
