"""Token ids of a conversation's pieces, built turn by turn: a prompt, then each new environment
message appended after what the model sampled, without re-rendering earlier turns from text. The
rollout server builds episodes this way and SFT builds its multi-turn examples the same way, so both
see the same ids for the same conversation.

Two codecs, chosen by the run config's `prompt` section (`make_codec`): `ChatCodec` renders with
the model's own chat template (instruct models); `PlainCodec` renders plain text for base models,
which have none: an optional few-shot prefix, the messages' contents, a suffix that cues the answer,
with BOS as the tokenizer's own settings say."""

from __future__ import annotations

from typing import Any

# `prompt` below is the run config's prompt section (format, prefix, suffix, separator, stop), taken
# by its fields: the domain layer does not import the config.
PromptSection = Any

# Stand-ins for the history when rendering only an environment's new messages.
_HISTORY = [{"role": "user", "content": "."}, {"role": "assistant", "content": "."}]


def as_dicts(messages) -> list[dict[str, str]]:
    out = []
    for m in messages:
        d = {"role": m.role, "content": m.content}
        if m.name:
            d["name"] = m.name
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def make_codec(tokenizer, prompt: PromptSection | None = None) -> PromptCodec:
    """The codec the run config's prompt section asks for (unset: `auto`)."""
    fmt = prompt.format if prompt is not None else "auto"
    if fmt == "auto":
        fmt = "chat" if has_chat_template(tokenizer) else "plain"
    if fmt == "plain":
        return PlainCodec(tokenizer, prompt)
    if not has_chat_template(tokenizer):
        name = getattr(tokenizer, "name_or_path", "") or "the model"
        raise ValueError(f"prompt.format=chat, but the tokenizer of {name} has no chat template (a base model?); "
                         "set prompt.format=plain (optionally prompt.prefix with a few solved examples, "
                         "prompt.suffix and prompt.stop), or give the model a chat_template.jinja")
    return ChatCodec(tokenizer, prompt)


class PromptCodec:
    """What both codecs share: the tokenizer, its eos token, the run's stop strings, and how a whole
    conversation is laid out for supervised training."""

    format = ""

    def __init__(self, tokenizer, prompt: PromptSection | None = None) -> None:
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.eos_token_id
        self.stop: list[str] = list(prompt.stop) if prompt is not None else []

    def prompt(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        raise NotImplementedError

    def continuation(self, observation: list[dict], tools: list[dict] | None, ended_with_eos: bool) -> list[int]:
        raise NotImplementedError

    def conversation(self, messages: list[dict], tools: list[dict] | None) -> tuple[list[int], list[int], list[bool]]:
        """(prompt ids, completion ids, loss mask) of a whole conversation for supervised training:
        the prompt is everything before the first assistant message; each assistant message is its
        text's tokens and the eos token (mask true), each run of other messages after it is what
        `continuation` appends (mask false) -- the ids a multi-turn episode would hold."""
        first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
        if first is None:
            raise ValueError("the conversation has no assistant message to learn")
        prompt = self.prompt(messages[:first], tools)
        completion: list[int] = []
        mask: list[bool] = []
        i = first
        while i < len(messages):
            said = self.tokenizer.encode(messages[i]["content"], add_special_tokens=False) + [self.eos_id]
            completion += said
            mask += [True] * len(said)
            j = i + 1
            while j < len(messages) and messages[j]["role"] != "assistant":
                j += 1
            if j > i + 1 or j < len(messages):
                env = self.continuation(messages[i + 1: j], tools, ended_with_eos=True)
                completion += env
                mask += [False] * len(env)
            i = j
        return prompt, completion, mask


class ChatCodec(PromptCodec):
    """Token ids of a conversation's pieces, from the model's chat template."""

    format = "chat"

    def render(self, messages: list[dict], tools: list[dict] | None, *, generation_prompt: bool) -> list[int]:
        return list(self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=True,
                                                       add_generation_prompt=generation_prompt, return_dict=False))

    def prompt(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        if not messages:
            raise ValueError("an episode needs at least one message (the prompt or the environment's first "
                             "observation)")
        return self.render(messages, tools, generation_prompt=True)

    def continuation(self, observation: list[dict], tools: list[dict] | None, ended_with_eos: bool) -> list[int]:
        """The ids that follow an assistant turn: its end-of-turn token if the model did not sample
        one, the template's separator after it, the new messages, and the next generation prompt.
        Rendered after a stand-in history and cut off at the history's end: the template must render
        earlier turns the same whatever follows them (true of ChatML templates)."""
        base = self.render(_HISTORY, tools, generation_prompt=False)
        full = self.render(_HISTORY + observation, tools, generation_prompt=True)
        if full[: len(base)] != base:
            raise ValueError("the chat template renders earlier turns differently once messages follow them, so "
                             "appending turns token by token is impossible with it; use a template that does not")
        if self.eos_id not in base:
            raise ValueError("the chat template does not end an assistant turn with the tokenizer's eos token")
        end = len(base) - base[::-1].index(self.eos_id)  # just past the assistant turn's eos
        return ([] if ended_with_eos else [self.eos_id]) + base[end:] + full[len(base):]


class PlainCodec(PromptCodec):
    """Plain text for a model without a chat template: prefix + the messages' contents (joined by the
    separator) + suffix. The tokenizer's own special tokens lead the prompt (BOS where it adds one:
    Gemma's text is garbage without it); an eos it would append is left off, since the model is to
    go on from the prompt. Tools need a chat template: they are refused here."""

    format = "plain"

    def __init__(self, tokenizer, prompt: PromptSection | None = None) -> None:
        super().__init__(tokenizer, prompt)
        self.prefix = prompt.prefix if prompt is not None else ""
        self.suffix = prompt.suffix if prompt is not None else ""
        self.separator = prompt.separator if prompt is not None else "\n\n"
        specials = list(tokenizer("", add_special_tokens=True)["input_ids"])
        self.leading = [i for i in specials if i != self.eos_id]

    def text(self, messages: list[dict]) -> str:
        return self.separator.join(m["content"] for m in messages)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        if not messages:
            raise ValueError("an episode needs at least one message (the prompt or the environment's first "
                             "observation)")
        if tools:
            raise ValueError("prompt.format=plain cannot offer tools to the model (tool calls need a chat "
                             "template); use an instruct model with a chat template, or prompt.format=chat")
        return self.leading + self._encode(self.prefix + self.text(messages) + self.suffix)

    def continuation(self, observation: list[dict], tools: list[dict] | None, ended_with_eos: bool) -> list[int]:
        """The environment's new messages as text after what the model wrote, and the suffix again."""
        if tools:
            raise ValueError("prompt.format=plain cannot offer tools to the model (tool calls need a chat template)")
        return self._encode(self.separator + self.text(observation) + self.suffix)
