"""ChatCodec: an episode built turn by turn holds the same ids as the whole conversation rendered
at once (for conversations whose text tokenizes the same either way), on both tiny tokenizers."""

import pytest

from rlmesh.learner.devtools.tiny_model import build_tokenizer
from rlmesh.services.domain.chat import ChatCodec
from rlmesh.services.domain.tasks import ADD_TOOL

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 123, "b": 456}}\n</tool_call>'
CONVERSATION = [{"role": "user", "content": "What is 123 + 456?"}, {"role": "assistant", "content": CALL},
                {"role": "tool", "name": "add", "content": "579"}, {"role": "assistant", "content": "579"}]


@pytest.fixture(scope="module", params=["bytes", "bpe"])
def codec(request):
    return ChatCodec(build_tokenizer(request.param))


def test_plain_chatml_without_tools_is_unchanged():
    tok = build_tokenizer("bytes")
    text = tok.apply_chat_template([{"role": "user", "content": "3+4="}], add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("tools", [None, [ADD_TOOL]])
def test_turn_by_turn_equals_whole_rendering(codec, tools):
    prompt, completion, mask = codec.conversation(CONVERSATION, tools)
    whole = codec.render(CONVERSATION, tools, generation_prompt=False)
    # The whole rendering also holds the separator after the last end-of-turn, which nobody samples.
    assert prompt + completion == whole[: len(prompt) + len(completion)]
    assert whole[len(prompt) + len(completion):] == codec.tokenizer.encode("\n", add_special_tokens=False)
    learned = [t for t, m in zip(completion, mask) if m]
    tok = codec.tokenizer
    assert learned == tok.encode(CALL, add_special_tokens=False) + [codec.eos_id] + tok.encode("579") + [codec.eos_id]
    assert "tool\n579" in tok.decode([t for t, m in zip(completion, mask) if not m])


def test_continuation_closes_a_turn_cut_short(codec):
    obs = [{"role": "user", "content": "higher"}]
    after_eos = codec.continuation(obs, None, ended_with_eos=True)
    after_cut = codec.continuation(obs, None, ended_with_eos=False)
    assert after_cut == [codec.eos_id] + after_eos
    assert codec.tokenizer.decode(after_eos) == "\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n"


def test_a_template_that_rewrites_history_is_refused():
    tok = build_tokenizer("bytes")
    tok.chat_template = ("{{ messages | length }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                         "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(ValueError, match="renders earlier turns differently"):
        ChatCodec(tok).continuation([{"role": "user", "content": "x"}], None, ended_with_eos=True)


def test_conversation_needs_an_assistant_turn(codec):
    with pytest.raises(ValueError, match="no assistant message"):
        codec.conversation(CONVERSATION[:1], None)
