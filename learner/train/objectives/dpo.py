"""Direct preference optimisation as an objective: each (prompt, chosen, rejected) example becomes
two sequences sharing the prompt, scored against a frozen reference policy whose token logprobs
were computed before training (`rlmesh.learner.recipes.dpo`) and ride in the sequences'
`behaviour_logprobs`; the loss is sigmoid DPO, optionally plus the chosen answers' NLL (RPO)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

from rlmesh.learner.train.batch import MicroBatch, Sequence
from rlmesh.services.config import DPOSection, default

if TYPE_CHECKING:
    from rlmesh.services.domain.chat import ChatCodec

DPO_METRICS = ("reward_accuracy", "reward_margin", "chosen_reward", "rejected_reward", "chosen_nll")


class PreferenceExample(Protocol):
    """What DPO reads of a dataset example (`rlmesh.learner.data.examples.Example`)."""

    id: str
    prompt_messages: list[dict[str, str]]
    tools: list[dict[str, Any]]
    chosen: str | None
    rejected: str | None


def dpo_loss(logprobs_BT: torch.Tensor, micro: MicroBatch, beta: float,
             sft_weight: float = default(DPOSection, "sft_weight")
             ) -> tuple[torch.Tensor, dict[str, float]]:
    """Sigmoid DPO over (chosen, rejected) pairs laid out as consecutive rows [c0, r0, c1, r1, ...];
    the reference policy's token logprobs ride in `behaviour_logprobs_BT`. Implicit reward of a
    response: beta * (log pi - log ref), summed over its tokens. With `sft_weight` > 0, plus that
    times the chosen responses' mean token NLL (RPO): the margin alone can grow while the chosen
    answer itself becomes less likely. Normalised by the pairs in the whole step, so micro-batch
    splits do not change the gradient."""
    if micro.is_padding:  # keeps collective counts equal across ranks; no pairs in it
        return logprobs_BT.sum() * 0.0, dict.fromkeys(DPO_METRICS, 0.0)
    mask_BT = micro.loss_mask_BT
    rewards_B = beta * ((logprobs_BT - micro.behaviour_logprobs_BT) * mask_BT).sum(-1)
    if rewards_B.shape[0] % 2:
        raise ValueError("a DPO micro-batch holds an odd number of sequences: pairs were split; use an even "
                         "learner.micro_batch_size")
    pairs_P2 = rewards_B.view(-1, 2)
    margin_P = pairs_P2[:, 0] - pairs_P2[:, 1]
    chosen_nll_P = -(logprobs_BT * mask_BT).sum(-1)[0::2] / mask_BT.sum(-1)[0::2].clamp(min=1)
    num_pairs_in_step = micro.num_seqs_in_step / 2
    loss = (-torch.nn.functional.logsigmoid(margin_P) + sft_weight * chosen_nll_P).sum() / num_pairs_in_step
    with torch.no_grad():
        metrics = {"reward_accuracy": float((margin_P > 0).float().mean()), "reward_margin": float(margin_P.mean()),
                   "chosen_reward": float(pairs_P2[:, 0].mean()), "rejected_reward": float(pairs_P2[:, 1].mean()),
                   "chosen_nll": float(chosen_nll_P.mean())}
    return loss, metrics


class DPOObjective:
    name = "dpo"
    needs_old_logprobs = False
    needs_ref_logprobs = False
    skips_zero_advantage = False
    kl_in_reward = False
    temperature = 1.0

    def __init__(self, codec: ChatCodec, beta: float, sft_weight: float = default(DPOSection, "sft_weight")) -> None:
        self.codec, self.beta, self.sft_weight = codec, beta, sft_weight
        # example id -> its two sequences, built once: the reference logprobs are stored in them.
        self._pairs: dict[str, tuple[Sequence, Sequence]] = {}
        self._prompts: dict[str, list[int]] = {}

    def pair(self, ex: PreferenceExample) -> tuple[Sequence, Sequence]:
        """The pair as two sequences sharing the prompt; each response ends with the end-of-turn token."""
        if ex.id in self._pairs:
            return self._pairs[ex.id]
        if ex.id not in self._prompts:
            self._prompts[ex.id] = self.codec.prompt(ex.prompt_messages, ex.tools or None)
        prompt = self._prompts[ex.id]
        out = []
        for text in (ex.chosen, ex.rejected):
            ids = self.codec.tokenizer.encode(text, add_special_tokens=False) + [self.codec.eos_id]
            out.append(Sequence(prompt, ids, [True] * len(ids), group_key=ex.id))
        self._pairs[ex.id] = (out[0], out[1])
        return self._pairs[ex.id]

    def sequences(self, batch: list[PreferenceExample]) -> list[Sequence]:
        """[chosen_0, rejected_0, chosen_1, ...]: an even micro-batch size keeps each pair together."""
        return [s for ex in batch for s in self.pair(ex)]

    def loss(self, logprobs_BT: torch.Tensor, micro: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        return dpo_loss(logprobs_BT, micro, self.beta, self.sft_weight)
