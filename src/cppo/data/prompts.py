"""Prompt styles for reasoning tasks: R1 (``<think>``/``<answer>`` tags), boxed answer, or none.

``build_prompt`` turns a question into a TRL ``prompt``: chat messages (the tokenizer's chat
template is applied later by the trainer) or plain text for base models without a template.
"""

from __future__ import annotations

R1_SYSTEM_PROMPT = (
    "You are a careful problem solver. Before answering, reason through the problem step by step "
    "inside <think> </think> tags. Then write only the final answer inside <answer> </answer> tags. "
    "Your reply must have exactly this shape: <think> your reasoning </think> <answer> final answer "
    "</answer>"
)

BOXED_SYSTEM_PROMPT = (
    "Solve the problem. Please reason step by step, and put your final answer within \\boxed{}."
)

SYSTEM_PROMPTS: dict[str, str | None] = {
    "r1": R1_SYSTEM_PROMPT,
    "boxed": BOXED_SYSTEM_PROMPT,
    "none": None,
}
PROMPT_STYLES = tuple(SYSTEM_PROMPTS)


def build_prompt(question: str, style: str = "r1", conversational: bool = True):
    """A prompt for ``question`` in ``style`` ("r1", "boxed" or "none").

    Conversational: ``[{"role": "system", ...}, {"role": "user", "content": question}]`` (no
    system message for "none"). Plain text: ``"<system>\\n\\nUser: <question>\\nAssistant:"``, or
    the bare question for "none".
    """
    if style not in SYSTEM_PROMPTS:
        raise ValueError(f"unknown prompt style {style!r}; expected one of {list(PROMPT_STYLES)}")
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"question must be a non-empty string, got {question!r}")
    system = SYSTEM_PROMPTS[style]
    if conversational:
        messages = [{"role": "system", "content": system}] if system else []
        return messages + [{"role": "user", "content": question}]
    if system is None:
        return question
    return f"{system}\n\nUser: {question}\nAssistant:"
