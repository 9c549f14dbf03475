"""learner.freeze on the real FSDP2 backend (one rank, tiny models): the frozen parameters leave
the optimizer and stay as loaded through steps that move the rest; a tied output layer freezes
with its embedding; a pattern that matches nothing, or everything, is refused by name."""

from __future__ import annotations

import pytest
import torch

from tests.unit.learner.test_baseline import fixed_groups, make_trainer


def _steps(trainer, n: int = 2) -> dict[str, torch.Tensor]:
    seqs = trainer.objective.sequences(fixed_groups())
    for _ in range(n):
        trainer.step(seqs, 5e-2)
    return dict(trainer.backend._gathered())


def _loaded(model_dir) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()


def test_frozen_embedding_stays_while_the_rest_trains(tiny_model_dir):
    trainer = make_trainer(tiny_model_dir, 12, "learner.freeze=[embed_tokens]")
    backend = trainer.backend
    optimized = {id(p) for g in backend.optimizer.param_groups for p in g["params"]}
    names = {n for n, p in backend.model.named_parameters() if id(p) in optimized}
    assert names and not any("embed_tokens" in n for n in names)
    after, before = _steps(trainer), _loaded(tiny_model_dir)
    assert torch.equal(after["model.embed_tokens.weight"], before["model.embed_tokens.weight"])
    moved = [n for n in before if n != "model.embed_tokens.weight" and not torch.equal(after[n], before[n])]
    assert "lm_head.weight" in moved and any(".layers." in n for n in moved)


def test_a_tied_output_layer_freezes_with_its_embedding(tmp_path):
    from rlmesh.learner.devtools.tiny_model import write_tiny_model
    from rlmesh.services.config import TinyModelSection

    model_dir = write_tiny_model(TinyModelSection(arch="gemma3"), tmp_path / "gemma3", seed=0)
    trainer = make_trainer(model_dir, 12, "learner.freeze=[embed_tokens]")
    after, before = _steps(trainer, 1), _loaded(model_dir)
    assert torch.equal(after["lm_head.weight"], before["model.embed_tokens.weight"])
    assert not torch.equal(after["model.layers.0.mlp.up_proj.weight"], before["model.layers.0.mlp.up_proj.weight"])


def test_a_pattern_that_matches_nothing_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match=r"learner.freeze: 'embeddings_typo' matches no parameter.*model\.embed_tokens"):
        make_trainer(tiny_model_dir, 12, "learner.freeze=[embeddings_typo]")
    with pytest.raises(ValueError, match="freezes every parameter"):
        make_trainer(tiny_model_dir, 12, "learner.freeze=[.]")


def test_config_refuses_freeze_where_it_cannot_apply():
    from rlmesh.services.config import load_config

    with pytest.raises(Exception, match="LoRA already trains the adapter alone"):
        load_config(None, ["learner.freeze=[embed_tokens]", "learner.lora.rank=8"])
    with pytest.raises(Exception, match="built for the fsdp2 backend"):
        load_config(None, ["learner.freeze=[embed_tokens]", "learner.backend.type=megatron"])
    with pytest.raises(Exception, match="not a regular expression"):
        load_config(None, ["learner.freeze=[(unclosed]"])
