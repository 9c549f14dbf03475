"""Supervised fine-tuning as an objective: dataset examples rendered through the model's chat
template into sequences, and masked NLL on the assistant tokens."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any, Protocol

import torch

from rlmesh.learner.train.batch import MicroBatch, Sequence
from rlmesh.services.config import SFTSection, default

if TYPE_CHECKING:
    from rlmesh.services.domain.chat import ChatCodec


class SFTExample(Protocol):
    """What SFT reads of a dataset example (`rlmesh.learner.data.examples.Example`)."""

    id: str
    prompt_messages: list[dict[str, str]]
    tools: list[dict[str, Any]]
    reference: str | None
    demonstration: list[dict[str, str]]
    shortcut: list[dict[str, str]]
    rejected: str | None


def sft_target(example: SFTExample, rng: random.Random, label_noise: float) -> str:
    """The assistant turn to imitate. With probability `label_noise` a wrong one: the example's
    `rejected` answer where it has one (the reasoning demo's: a solution that stops a step early),
    else the reference with a stray "!" after it ("7!", which the exact-answer checker scores 0). The
    warm start learns the task from every example but also a habit that scores 0, which the demos'
    RL stage unlearns."""
    reference = example.reference
    if reference is None:
        raise ValueError(f"example {example.id!r} has no reference answer for SFT: give it a trailing assistant "
                         "message or metadata.answer")
    if label_noise and rng.random() < label_noise:
        return example.rejected if example.rejected is not None else reference + "!"
    return reference


def sft_conversation(example: SFTExample, rng: random.Random, label_noise: float) -> list[dict[str, str]]:
    """A multi-turn demonstration to imitate. With probability `label_noise` the example's shortcut
    instead (the calculator's: answer at once, without the tool, repeating the first number): the
    warm start takes the shortcut most of the time, and RL has to learn that the tool pays."""
    if label_noise and example.shortcut and rng.random() < label_noise:
        return example.shortcut
    return example.demonstration


def sft_loss(logprobs_BT: torch.Tensor, micro: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
    """Masked NLL over assistant tokens, normalised by the step's token count."""
    nll = -(logprobs_BT * micro.loss_mask_BT).sum() / micro.num_loss_tokens_in_step
    return nll, {"nll": float(nll.detach()) * micro.num_loss_tokens_in_step / max(float(micro.loss_mask_BT.sum()), 1.0)}


class SFTObjective:
    name = "sft"
    needs_old_logprobs = False
    needs_ref_logprobs = False
    skips_zero_advantage = False
    kl_in_reward = False
    temperature = 1.0

    def __init__(self, codec: ChatCodec, rng: random.Random,
                 label_noise: float = default(SFTSection, "label_noise")) -> None:
        # `rng` is the run's one stream: the offline loop draws each batch from it and label noise
        # draws in between, so a seed reproduces the whole run.
        self.codec, self.rng, self.label_noise = codec, rng, label_noise
        self._prompts: dict[str, list[int]] = {}  # example id -> prompt ids (single-turn examples)
        # (example id, shortcut?) -> the rendered demonstration: rendering a conversation through the chat
        # template (once per assistant turn, for its mask) cost more than the step of a tiny model.
        self._conversations: dict[tuple[str, bool], tuple] = {}

    def sequence(self, example: SFTExample) -> Sequence:
        """The example as prompt + the assistant turn(s) to learn: a whole demonstration (loss on its
        assistant turns only), or the reference answer followed by the end-of-turn token."""
        if example.demonstration:
            conversation = sft_conversation(example, self.rng, self.label_noise)
            key = (example.id, conversation is example.shortcut)
            if key not in self._conversations:
                self._conversations[key] = tuple(self.codec.conversation(conversation, example.tools))
            return Sequence(*self._conversations[key])
        if example.id not in self._prompts:
            self._prompts[example.id] = self.codec.prompt(example.prompt_messages, example.tools)
        target = self.codec.tokenizer.encode(sft_target(example, self.rng, self.label_noise),
                                             add_special_tokens=False) + [self.codec.eos_id]
        return Sequence(self._prompts[example.id], target, [True] * len(target))

    def sequences(self, batch: list[SFTExample]) -> list[Sequence]:
        return [self.sequence(ex) for ex in batch]

    def loss(self, logprobs_BT: torch.Tensor, micro: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        return sft_loss(logprobs_BT, micro)
