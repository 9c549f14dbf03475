"""Tiny random-initialised causal LMs of real architectures (Qwen2, Llama) with a real byte-level
BPE tokenizer and a chat template (with tools), written as a local HF directory that both
`transformers` and vLLM load. Used by tests and the demos (nothing can be downloaded from a hub here).

Two tokenizers: `bytes` (every byte one token, no merges: digits stay single tokens, which suits the
arithmetic demo) and `bpe` (merges learned with the `tokenizers` library from a built-in corpus of
the tasks' text, so that, as with any real model, a sampled token sequence is often not what
re-tokenizing its text would give; multi-turn episodes are tested on it)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlmesh.services.config import TinyModelSection

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML turns. With `tools=`, a system turn lists each tool compactly (name, parameters,
# description: a tiny model's context is short) and says how to call one; tool results are `tool`
# turns. Without tools the rendering is plain ChatML, unchanged from earlier versions.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n{% endif %}"
    "Tools:\n{% for tool in tools %}{% set f = tool['function'] if 'function' in tool else tool %}"
    "{{ f['name'] }}({{ f.get('parameters', {}).get('properties', {}) | join(', ') }}): "
    "{{ f.get('description', '') }}\n{% endfor %}"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call><|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if not (tools and loop.first and message['role'] == 'system') %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def bpe_corpus(seed: int = 0, num_lines: int = 4000) -> list[str]:
    """Text like the tasks' own (sums, tool calls and results, guessing-game turns), for learning
    merges. Deterministic, so a given seed always gives the same tokenizer."""
    import random

    rng = random.Random(seed)
    words = ("What is the sum of plus minus times answer number only Use tool add then with Guess higher "
             "lower correct error arguments name result integer two first second call").split()
    lines = []
    for _ in range(num_lines):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        kind = rng.randrange(5)
        if kind == 0:
            lines.append(f"{a % 10}+{b % 10}={a % 10 + b % 10}")
        elif kind == 1:
            lines.append(f"What is {a} + {b}? Use the add tool, then answer with the number only.")
        elif kind == 2:
            lines.append(f'<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>')
        elif kind == 3:
            lines.append(f"{a + b} {rng.choice(['higher', 'lower', 'correct'])} Guess {a % 17}")
        else:
            lines.append(" ".join(rng.choice(words) for _ in range(8)))
    # The chat template's own words.
    lines += ["system\nTools:\nadd(a, b): Add two integers and return their sum.\n"
              'Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call>', "user\n", "assistant\n",
              "tool\n"] * 50
    return lines


def _byte_level_bpe(kind: str, vocab_size: int, seed: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if kind == "bytes":
        vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
        for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
            vocab[ch] = len(vocab)
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(bpe_corpus(seed), trainer=trainer)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


def build_tokenizer(kind: str = "bytes", vocab_size: int = 512, seed: int = 0):
    """`bytes`: byte-level BPE with no merges, every byte a token (digits stay single tokens).
    `bpe`: byte-level BPE with merges learned from `bpe_corpus` up to `vocab_size` tokens."""
    from transformers import PreTrainedTokenizerFast

    if kind not in ("bytes", "bpe"):
        raise ValueError(f"tokenizer kind {kind!r}: choose bytes or bpe")
    tok = _byte_level_bpe(kind, vocab_size, seed)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def write_tiny_model(spec: TinyModelSection, output: str | Path, *, seed: int = 0) -> Path:
    """Write the model to `output`. It is written beside it and renamed into place, so a process
    waiting for `output` to appear (`rlmesh up`'s rollout servers, during SFT) never reads half of it."""
    target = Path(output)
    staging = target.with_name(f".{target.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    _write(spec, staging, seed)
    if target.is_dir() and not any(target.iterdir()):
        target.rmdir()
    if target.exists():  # an existing model directory: its files are replaced one by one
        for f in staging.iterdir():
            os.replace(f, target / f.name)
        staging.rmdir()
    else:
        staging.rename(target)
    return target


def _write(spec: TinyModelSection, out: Path, seed: int) -> None:
    import torch
    import transformers

    out.mkdir(parents=True)
    tokenizer = build_tokenizer(spec.tokenizer, spec.bpe_vocab_size, seed)
    vocab_size = ((len(tokenizer) + 63) // 64) * 64
    common = dict(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    if spec.arch == "qwen2":
        config = transformers.Qwen2Config(**common)
        model_cls = transformers.Qwen2ForCausalLM
    else:
        config = transformers.LlamaConfig(**common)
        model_cls = transformers.LlamaForCausalLM
    torch.manual_seed(seed)
    model = model_cls(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    # vLLM reads generation_config.json for stop tokens; make the chat end-of-turn explicit.
    gen = json.loads((out / "generation_config.json").read_text())
    gen["eos_token_id"] = tokenizer.eos_token_id
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
