"""``--chat auto|on|off`` and ``--system-prompt``: whether raw-text prompts and observations reach the model through
its chat template, as TRL renders a conversational dataset.

With chat on (``auto``: when the tokenizer has a chat template), an episode's raw-text first observation — an
environment's problem, a reasoning-gym question, a plain ``--data`` prompt — becomes the conversation
``[system?, {"role": "user", "content": text}]`` (:meth:`ChatFormat.first`), rendered with the template and its
generation prompt; a raw-text observation answering a turn becomes the next user turn
(:meth:`ChatFormat.later`), appended with the template's turn markers and the next generation prompt
(:func:`~spinwheel.rl.llm.episode_tokens.chat_suffix`). Chat observations (``messages`` / conversational
``prompt`` lines, environments that return messages) are rendered with the template in every mode, as before.
``--system-prompt`` goes first in every conversation that has no system message of its own (a line's own system
message wins); it needs chat on. ``off`` keeps raw text. ``auto`` counts only a checkpoint's own template: the
built-in character tokenizer's minimal one (:data:`~spinwheel.models.tokenizer.DEFAULT_CHAT_TEMPLATE`, which its
saved checkpoints carry too) does not, since the built-in models learn raw text (``12+34=``) — so ``auto`` is ``off``
for them and ``on`` for a real chat model such as SmolLM2-Instruct.
"""

from __future__ import annotations

from dataclasses import dataclass

from spinwheel.envs.base import Message, Observation
from spinwheel.models.tokenizer import DEFAULT_CHAT_TEMPLATE

CHAT_MODES: tuple[str, ...] = ("auto", "on", "off")
OBSERVATION_ROLE = "user"  # the role of an environment's raw-text answer to a turn (every template knows it)


@dataclass(frozen=True)
class ChatFormat:
    """Raw text rendered as chat turns (see the module docstring); ``system_prompt`` opens each conversation."""

    system_prompt: str | None = None

    def first(self, obs: Observation) -> list[Message]:
        """The first observation as the conversation the template renders (the system prompt first)."""
        messages = [{"role": "user", "content": obs}] if isinstance(obs, str) else list(obs)
        if self.system_prompt is not None and (not messages or messages[0].get("role") != "system"):
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        return messages

    def later(self, obs: Observation) -> list[Message]:
        """An observation answering a turn as the messages that follow the assistant's turn."""
        return [{"role": OBSERVATION_ROLE, "content": obs}] if isinstance(obs, str) else list(obs)


def resolve_chat(mode: str, tokenizer, system_prompt: str | None = None) -> ChatFormat | None:
    """The run's chat format (None: raw text) for ``--chat mode`` with ``tokenizer``; a one-line :class:`ValueError`
    for ``on`` without a chat template or a system prompt without chat."""
    if mode not in CHAT_MODES:
        raise ValueError(f"--chat must be one of {', '.join(CHAT_MODES)}, got {mode!r}")
    template = getattr(tokenizer, "chat_template", None)
    has_template = bool(template)
    if mode == "on" and not has_template:
        raise ValueError(
            "--chat on: this model's tokenizer has no chat template (tokenizer_config.json 'chat_template' or "
            "chat_template.jinja); use --chat off for raw text"
        )
    chat = mode == "on" or (mode == "auto" and has_template and template != DEFAULT_CHAT_TEMPLATE)
    if system_prompt is not None and not chat:
        if mode == "off":
            raise ValueError("--system-prompt needs chat rendering: drop --chat off, or drop --system-prompt")
        raise ValueError(
            "--system-prompt needs chat rendering, and --chat auto found no chat template of the model's own (the "
            "built-in tokenizer's minimal one does not count): give --chat on, or drop --system-prompt"
        )
    return ChatFormat(system_prompt) if chat else None
