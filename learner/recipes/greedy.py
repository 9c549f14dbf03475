"""Greedy completions of held-out prompts with a plain HF model (`generate`), outside the mesh: for
offline objectives (DPO) and for benchmarks that score checkpoints of other trainers."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rlmesh.learner.data.examples import Example
from rlmesh.services.domain.chat import make_codec

if TYPE_CHECKING:
    from rlmesh.services.config import PromptSection


def greedy_completions(model_dir: Path | str, examples: list[Example], max_tokens: int,
                       tokenizer_dir: Path | str | None = None, weights_dtype: str = "float32",
                       prompt: PromptSection | None = None) -> list[str]:
    """Each example's prompt rendered as the run's `prompt` section says (the chat template, or
    plain text), completed greedily up to `max_tokens`, the end-of-turn token or a stop string,
    decoded without special tokens. The weights are rounded to `weights_dtype`
    first (then decoded in float32), so a run that trained and sampled in bfloat16 is scored with
    the weights it served, not with float32 master weights that hold updates no sample was drawn with."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir or model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    if weights_dtype != "float32":
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(getattr(torch, weights_dtype)))
    codec = make_codec(tokenizer, prompt)
    texts = []
    with torch.no_grad():
        for ex in examples:  # one at a time: no padding, so nothing but the prompt conditions the answer
            ids = codec.prompt(ex.prompt_messages, ex.tools or None)
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=max_tokens, do_sample=False, eos_token_id=codec.eos_id,
                                 pad_token_id=tokenizer.pad_token_id)
            completion = out[0, len(ids):].tolist()
            if codec.eos_id in completion:
                completion = completion[: completion.index(codec.eos_id)]
            text = tokenizer.decode(completion, skip_special_tokens=True)
            cuts = [text.index(s) for s in codec.stop if s in text]
            texts.append(text[: min(cuts)] if cuts else text)
    return texts
