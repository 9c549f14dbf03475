"""Token ids of a chat conversation's pieces, from the model's own chat template, built turn by
turn: a prompt, then each new environment message appended after what the model sampled, without
re-rendering earlier turns from text. The rollout server builds episodes this way and SFT builds
its multi-turn examples the same way, so both see the same ids for the same conversation."""

from __future__ import annotations

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


class ChatCodec:
    """Token ids of a conversation's pieces, from the model's chat template."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.eos_token_id

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
