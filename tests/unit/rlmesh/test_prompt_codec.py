"""The prompt formats: a chat template for instruct models, plain text for base models (prefix,
contents, suffix; BOS where the tokenizer adds one, never a trailing EOS), chosen by `prompt.format`."""

import pytest
from tokenizers.processors import TemplateProcessing

from rlmesh.learner.devtools.tiny_model import build_tokenizer
from rlmesh.services.config import PromptSection
from rlmesh.services.domain.chat import ChatCodec, PlainCodec, make_codec

QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]


def base_tokenizer(add_bos: bool):
    """The tiny byte tokenizer without a chat template; with `add_bos`, it adds <|endoftext|> in front
    (as Gemma's adds <bos>), and an eos at the end too, as some tokenizers are configured to."""
    tok = build_tokenizer("bytes")
    tok.chat_template = None
    if add_bos:
        bos, eos = tok.convert_tokens_to_ids("<|endoftext|>"), tok.eos_token_id
        tok.backend_tokenizer.post_processor = TemplateProcessing(
            single="<|endoftext|> $A <|im_end|>", special_tokens=[("<|endoftext|>", bos), ("<|im_end|>", eos)])
    return tok


def test_auto_takes_the_template_where_there_is_one_and_plain_text_where_not():
    assert isinstance(make_codec(build_tokenizer("bytes"), PromptSection()), ChatCodec)
    assert isinstance(make_codec(base_tokenizer(False), PromptSection()), PlainCodec)
    assert isinstance(make_codec(build_tokenizer("bytes"), PromptSection(format="plain")), PlainCodec)


def test_chat_without_a_template_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="prompt.format=plain"):
        make_codec(base_tokenizer(False), PromptSection(format="chat"))


def test_plain_text_is_prefix_contents_suffix_with_the_tokenizers_bos_and_no_eos():
    tok = base_tokenizer(True)
    codec = make_codec(tok, PromptSection(format="plain", prefix="Q: 1 + 1?\nA: 2\n\n", suffix="\nA:", stop=["\nQ:"]))
    ids = codec.prompt([{"role": "system", "content": "Answer."}, *QUESTION], None)
    assert ids[0] == tok.convert_tokens_to_ids("<|endoftext|>")  # BOS, as the tokenizer's own settings say
    assert ids[-1] != tok.eos_token_id  # the model goes on from the prompt
    assert tok.decode(ids[1:]) == "Q: 1 + 1?\nA: 2\n\nAnswer.\n\nWhat is 2 + 3?\nA:"
    assert codec.stop == ["\nQ:"]
    no_bos = make_codec(base_tokenizer(False), PromptSection(format="plain")).prompt(QUESTION, None)
    assert base_tokenizer(False).decode(no_bos) == "What is 2 + 3?"


def test_plain_text_turns_and_supervised_conversations():
    tok = base_tokenizer(False)
    codec = make_codec(tok, PromptSection(format="plain", suffix="\nA:"))
    assert tok.decode(codec.continuation([{"role": "user", "content": "Wrong."}], None, False)) == "\n\nWrong.\nA:"
    prompt, completion, mask = codec.conversation([*QUESTION, {"role": "assistant", "content": " 5"}], None)
    assert tok.decode(prompt) == "What is 2 + 3?\nA:"
    assert completion[-1] == tok.eos_token_id and tok.decode(completion[:-1]) == " 5" and all(mask)


def test_tools_need_a_chat_template():
    codec = make_codec(base_tokenizer(False), PromptSection(format="plain"))
    with pytest.raises(ValueError, match="tool calls need a chat template"):
        codec.prompt(QUESTION, [{"type": "function", "function": {"name": "add"}}])
