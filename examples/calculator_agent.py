"""A black-box agent for the ``calculator`` task, written against the OpenAI API only (no spinwheel import needed
to run it against any OpenAI-compatible server serving a model trained on the calculator format).

The agent asks the model for ``317*46=``; when the model calls the tool (``<calc>317*46</calc>``, the call ending
at the stop string) the agent computes it, appends ``=14582\\n`` to the text so far and asks again; the answer's
last integer is checked against the product. Up to ``max_turns`` calls, as the ``calculator`` environment allows.

Train it with spinwheel (the policy served on a local base URL, every call's tokens recorded)::

    from spinwheel.rl.llm.agents.agent_proxy import load_agent, play_agent_episodes
    agent = load_agent("examples/calculator_agent.py:agent")
    episodes = play_agent_episodes(llm, agent, tasks(8), group_size=4)

or as a command (GRPO on the agent's runs, held-out success before and after; its tasks: ``task`` below)::

    spinwheel grpo --model runs/agent-sft/checkpoint --agent examples/calculator_agent.py:agent --steps 20

Each call's prompt is the previous prompt, the model's text and the tool's answer, so the calls chain into one
token sequence (spinwheel trains on exactly the tokens the engine sampled). :func:`chat_agent` does the same through
chat completions.
"""

from __future__ import annotations

import ast
import operator
import random
import re

CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculate(expression: str) -> int | None:
    """The tool: an integer expression over ``+ - *`` and parentheses (never ``eval``), or None."""
    if len(expression) > 40 or not re.fullmatch(r"[0-9+\-*() ]+", expression):
        return None
    try:
        return _value(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, RecursionError):
        return None


def _value(node: ast.AST) -> int | None:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _value(node.operand)
        return None if inner is None else -inner
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _value(node.left), _value(node.right)
        return None if left is None or right is None else _OPS[type(node.op)](left, right)
    return None


def reward(answer: str, product: int) -> float:
    """1.0 when the answer's last integer is the product written canonically (``3874``, not ``03874``), as the
    ``calculator`` environment scores it."""
    numbers = re.findall(r"-?\d+", answer)
    return float(bool(numbers) and numbers[-1] == str(product))


def agent(client, task: dict) -> float:
    """Solve ``task`` (``{"a": 317, "b": 46}``, optional ``max_turns``, ``max_tokens``, ``temperature``) with the
    model behind ``client`` (an ``openai.OpenAI``); the reward."""
    a, b = task["a"], task["b"]
    prompt = f"{a}*{b}="
    for _ in range(task.get("max_turns", 3)):
        response = client.completions.create(
            model=task.get("model", "policy"),
            prompt=prompt,
            max_tokens=task.get("max_tokens", 24),
            temperature=task.get("temperature", 1.0),
            stop=["</calc>"],
            extra_body={"include_stop_str_in_output": True},  # vLLM's: the closing tag stays in the text
        )
        text = response.choices[0].text
        call = CALL.search(text)
        if call is None:  # the final answer
            return reward(text, a * b)
        value = calculate(call.group(1))
        prompt += text + ("=error\n" if value is None else f"={value}\n")
    return 0.0  # still calling the tool at the last turn


def chat_agent(client, task: dict) -> float:
    """:func:`agent` through chat completions: the problem as the user's message, each tool result as the next user
    message. The chat template re-renders the history each call; where it renders the model's text to the tokens
    the model sampled, the calls chain into one episode (spinwheel counts the calls that do not)."""
    a, b = task["a"], task["b"]
    messages = [{"role": "user", "content": f"{a}*{b}="}]
    for _ in range(task.get("max_turns", 3)):
        response = client.chat.completions.create(
            model=task.get("model", "policy"),
            messages=messages,
            max_tokens=task.get("max_tokens", 24),
            temperature=task.get("temperature", 1.0),
            stop=["</calc>"],
            extra_body={"include_stop_str_in_output": True},
        )
        text = response.choices[0].message.content or ""
        call = CALL.search(text)
        if call is None:
            return reward(text, a * b)
        value = calculate(call.group(1))
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"={value}"}]
    return 0.0


def tasks(num: int, seed: int = 0, left_digits: int = 3, right_digits: int = 2) -> list[dict]:
    """``num`` multiplication tasks (``left_digits`` × ``right_digits``)."""
    rng = random.Random(seed)
    lo_a, lo_b = 10 ** (left_digits - 1), 10 ** (right_digits - 1)
    return [
        {"a": rng.randint(lo_a, 10 * lo_a - 1), "b": rng.randint(lo_b, 10 * lo_b - 1), "seed": seed * 100_003 + i}
        for i in range(num)
    ]


def task(seed: int, split: str = "train") -> dict:
    """Task ``seed`` of a split, the ``calculator`` environment's problem for that seed (its train and test splits
    never share a problem)."""
    from spinwheel.envs.calculator import CalculatorEnv

    a, b = CalculatorEnv(split).problem(seed)
    return {"a": a, "b": b, "seed": seed}
