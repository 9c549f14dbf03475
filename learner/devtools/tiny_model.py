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


def write_tiny_model(spec: TinyModelSection, output: str | Path, *, seed: int = 0,
                     tie_word_embeddings: bool | None = None) -> Path:
    """Write the model to `output`. It is written beside it and renamed into place, so a process
    waiting for `output` to appear (`rlmesh up`'s rollout servers, during SFT) never reads half of it.
    `tie_word_embeddings`: None takes the family's own habit (`TIED_BY_DEFAULT`: Gemma 3 and small
    Qwen3 tie their output layer to the input embedding, the rest do not)."""
    target = Path(output)
    staging = target.with_name(f".{target.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    _write(spec, staging, seed, tie_word_embeddings)
    if target.is_dir() and not any(target.iterdir()):
        target.rmdir()
    if target.exists():  # an existing model directory: its files are replaced one by one
        for f in staging.iterdir():
            os.replace(f, target / f.name)
        staging.rmdir()
    else:
        staging.rename(target)
    return target


def _write(spec: TinyModelSection, out: Path, seed: int, tie_word_embeddings: bool | None) -> None:
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
    if spec.arch in ("qwen2", "llama") and tie_word_embeddings is None:
        # The original two, unchanged: their files stay byte-identical for a given seed.
        config = (transformers.Qwen2Config if spec.arch == "qwen2" else transformers.LlamaConfig)(**common)
        model_cls = transformers.Qwen2ForCausalLM if spec.arch == "qwen2" else transformers.LlamaForCausalLM
    else:
        config, model_cls = _family_config(spec, common, tie_word_embeddings)
    torch.manual_seed(seed)
    model = model_cls(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    # vLLM reads generation_config.json for stop tokens; make the chat end-of-turn explicit.
    gen = json.loads((out / "generation_config.json").read_text())
    gen["eos_token_id"] = tokenizer.eos_token_id
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))


TIED_BY_DEFAULT = frozenset({"gemma3", "qwen3"})
"""Families whose small checkpoints tie the output layer to the input embedding (Gemma 3 270M,
Qwen3-0.6B); a tiny model of one of them is tied unless asked otherwise."""

MOE = dict(num_experts=4, num_experts_per_tok=2)


def _family_config(spec: TinyModelSection, common: dict, tied: bool | None):
    """(config, model class) of a tiny model of `spec.arch` beyond the original two. MoE families get
    4 experts (2 routed per token) of `intermediate_size // 2`; sizes stay a few MB."""
    import transformers

    arch = spec.arch
    kw = {**common, "tie_word_embeddings": arch in TIED_BY_DEFAULT if tied is None else tied}
    head_dim = spec.hidden_size // spec.num_heads
    moe_width = max(spec.intermediate_size // 2, 8)
    if arch in ("qwen2", "llama"):
        cls = transformers.Qwen2Config if arch == "qwen2" else transformers.LlamaConfig
        return cls(**kw), getattr(transformers, f"{'Qwen2' if arch == 'qwen2' else 'Llama'}ForCausalLM")
    if arch == "qwen3":
        return transformers.Qwen3Config(**kw, head_dim=head_dim), transformers.Qwen3ForCausalLM
    if arch == "gemma3":
        # Gemma 3's layer pattern in miniature: sliding-window layers with a full-attention one last.
        layer_types = ["sliding_attention"] * (spec.num_layers - 1) + ["full_attention"]
        config = transformers.Gemma3TextConfig(**kw, head_dim=head_dim, query_pre_attn_scalar=head_dim,
                                               sliding_window=64, layer_types=layer_types)
        return config, transformers.Gemma3ForCausalLM
    if arch == "mistral":
        return transformers.MistralConfig(**kw, head_dim=head_dim, sliding_window=None), transformers.MistralForCausalLM
    if arch == "phi3":
        return transformers.Phi3Config(**kw, original_max_position_embeddings=2048), transformers.Phi3ForCausalLM
    if arch == "olmo2":
        return transformers.Olmo2Config(**kw), transformers.Olmo2ForCausalLM
    if arch == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(**kw, **MOE, moe_intermediate_size=moe_width,
                                             shared_expert_intermediate_size=moe_width, decoder_sparse_step=1)
        return config, transformers.Qwen2MoeForCausalLM
    if arch == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**kw, **MOE, head_dim=head_dim, moe_intermediate_size=moe_width,
                                             decoder_sparse_step=1)
        return config, transformers.Qwen3MoeForCausalLM
    if arch == "mixtral":
        config = transformers.MixtralConfig(**{**kw, "intermediate_size": moe_width}, head_dim=head_dim,
                                            num_local_experts=MOE["num_experts"],
                                            num_experts_per_tok=MOE["num_experts_per_tok"])
        return config, transformers.MixtralForCausalLM
    raise ValueError(f"model.arch={arch!r}: choose one of {', '.join(ARCHS)}")


ARCHS = ("qwen2", "llama", "qwen3", "gemma3", "mistral", "phi3", "olmo2", "qwen2_moe", "qwen3_moe", "mixtral")
"""Every `model.arch` a tiny model can have (TinyModelSection.arch)."""
