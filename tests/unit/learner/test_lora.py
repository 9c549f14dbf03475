"""learner.lora on the real FSDP2 backend (one rank, tiny model): only the adapter trains and is
broadcast; the merged model, the stored adapter and the served adapter are the same policy."""

from __future__ import annotations

import json

import pytest
import torch

from tests.unit.learner.test_baseline import fixed_groups, make_trainer

LORA = ("learner.lora.rank=8", "learner.lora.alpha=32")


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


@pytest.fixture(scope="module")
def trained(tiny_model_dir):
    trainer = make_trainer(tiny_model_dir, 12, *LORA)
    seqs = trainer.objective.sequences(fixed_groups())
    for _ in range(3):
        trainer.step(seqs, 5e-2)
    return trainer


def test_only_the_adapter_trains_and_is_broadcast(trained, tiny_model_dir):
    backend = trained.backend
    trainable = [n for n, p in backend.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    optimized = sum(p.numel() for g in backend.optimizer.param_groups for p in g["params"])
    assert optimized == sum(p.numel() for p in backend.model.parameters() if p.requires_grad)
    metas = trained.weight_metas()
    sent = list(trained.stream_weights())
    assert [m.name for m in metas] == [n for n, _ in sent]
    assert all(m.name.startswith("base_model.model.model.layers.") and ".default." not in m.name for m in metas)
    assert [tuple(t.shape) for _, t in sent] == [m.shape for m in metas]
    # 2 layers x 7 projections, A and B each
    assert len(metas) == 28
    from transformers import AutoModelForCausalLM

    base_bytes = sum(p.numel() * 4 for p in AutoModelForCausalLM.from_pretrained(tiny_model_dir).parameters())
    assert sum(m.nbytes for m in metas) < base_bytes / 10


def test_training_moves_the_adapter_not_the_base(trained, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    frozen = {n.removeprefix("base_model.model.").replace(".base_layer.", "."): t
              for n, t in trained.backend._gathered() if ".lora_" not in n}
    assert sorted(frozen) == sorted(base)
    for name, t in frozen.items():
        assert torch.equal(t, base[name]), name
    b = [t for n, t in trained.stream_weights() if ".lora_B." in n]
    assert max(float(t.abs().max()) for t in b) > 0  # lora_B starts at zero: the steps moved it


def test_merged_stored_and_served_adapters_are_one_policy(trained, tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = [5, 17, 42, 99, 3, 250, 7]
    backend = trained.backend
    want = _logits(backend.model.eval(), ids)

    trained.save_pretrained(tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("lora" in n for n in merged.state_dict())
    torch.testing.assert_close(_logits(merged, ids), want, atol=1e-5, rtol=1e-5)

    backend.save_adapter(tmp_path / "adapter")
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["lora_alpha"] == 32
    stored = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tmp_path / "adapter")
    torch.testing.assert_close(_logits(stored, ids), want, atol=1e-5, rtol=1e-5)

    # The served form (alpha / rank folded into lora_B, config read off the tensors) as the
    # rollout server writes it for vLLM.
    from rlmesh.services.weights.lora import served_config, write_adapter

    tensors = dict(trained.stream_weights())
    write_adapter(tmp_path / "served", tensors, served_config(tensors))
    served = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tmp_path / "served")
    torch.testing.assert_close(_logits(served, ids), want, atol=1e-5, rtol=1e-5)


def test_lora_needs_the_fsdp2_backend_and_the_gloo_engine():
    from rlmesh.services.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="learner.lora.rank=8 needs the fsdp2 backend"):
        load_config(None, ["learner.lora.rank=8", "learner.backend.type=megatron"])
    with pytest.raises(ConfigError, match="weight_sync.backend=nccl"):
        load_config(None, ["learner.lora.rank=8", "weight_sync.backend=nccl"])
    with pytest.raises(ConfigError, match="learner.lora.rank"):
        load_config(None, ["learner.lora.rank=7"])


def test_checkpoint_exports_the_adapter_or_the_merged_model(trained, tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rlmesh.learner.train.checkpoint import export_hf, save_checkpoint

    ids = [9, 8, 7, 6, 5]
    want = _logits(trained.backend.model.eval(), ids)
    ckpt = save_checkpoint(tmp_path / "checkpoints", 3, trained, str(tiny_model_dir), {}, keep_last=2)
    assert (ckpt / "adapter" / "adapter_model.safetensors").is_file()

    adapter = export_hf(ckpt, tmp_path / "adapter_out")
    assert not (adapter / "model.safetensors").exists()
    assert (adapter / "tokenizer.json").is_file()
    stored = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), adapter)
    torch.testing.assert_close(_logits(stored, ids), want, atol=1e-5, rtol=1e-5)

    merged = export_hf(ckpt, tmp_path / "merged_out", merge=True)
    model = AutoModelForCausalLM.from_pretrained(merged)
    assert not any("lora" in n for n in model.state_dict())
    torch.testing.assert_close(_logits(model, ids), want, atol=1e-5, rtol=1e-5)
