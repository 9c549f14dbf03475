"""The prompt section of the run config: how a conversation becomes the model's token ids. Instruct
models use their chat template; base models (no template) take plain text, with an optional
few-shot prefix, a suffix that cues the answer, and stop strings. Every tier that renders prompts
(rollout server, learner evaluation, SFT, DPO) reads this one section."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlmesh.services.config.base import Section


class PromptSection(Section):
    format: Literal["auto", "chat", "plain"] = "auto"
    """chat: the tokenizer's chat template; plain: text (prefix + the messages' contents + suffix), BOS/EOS as the tokenizer's own settings say; auto: chat where the tokenizer has a template, else plain."""
    prefix: str = ""
    """Plain format: text before every prompt, e.g. a few solved examples ("Q: What is 2 + 3?\\nA: 5\\n\\n")."""
    suffix: str = ""
    """Plain format: text after the prompt that cues the answer, e.g. "\\nA:"."""
    separator: str = "\n\n"
    """Plain format: text between the contents of consecutive messages (a system message and the user's, or an environment's reply in an episode)."""
    stop: list[str] = Field(default_factory=list)
    """Strings that end a completion (vLLM stop strings), e.g. ["\\nQ:"] so a base model does not go on to write the next few-shot question; a group's own sampling.stop takes precedence."""
