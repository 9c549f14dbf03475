"""The Megatron backend's HF <-> Megatron converter, without processes: splitting HF tensors into
every TP rank's shard and joining the shards back reproduces every tensor exactly, for more,
as many and fewer KV groups than TP ranks; each rank's piece of an HF tensor is the torch.chunk
shard the DCP checkpoint layout declares; layout errors name the fix."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")

from rlmesh.learner.train.backends.megatron import SHARD_DIM, _check_layout, _Converter  # noqa: E402


def hf_config(arch: str = "qwen2", heads: int = 8, groups: int = 2, layers: int = 4, tied: bool = False):
    cls = transformers.Qwen2Config if arch == "qwen2" else transformers.LlamaConfig
    return cls(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
               num_attention_heads=heads, num_key_value_heads=groups, tie_word_embeddings=tied)


def hf_tensors(config, seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


@pytest.mark.parametrize("arch,heads,groups,tp,pp", [
    ("qwen2", 8, 2, 1, 1), ("qwen2", 8, 2, 2, 2), ("qwen2", 8, 2, 4, 1),  # groups >= ranks
    ("qwen2", 8, 1, 2, 1), ("qwen2", 8, 2, 8, 4),                         # fewer groups than ranks
    ("llama", 8, 8, 2, 2), ("llama", 8, 4, 4, 1),
])
def test_split_then_join_reproduces_every_hf_tensor(arch, heads, groups, tp, pp):
    config = hf_config(arch, heads, groups)
    want = hf_tensors(config)
    conv = _Converter(config, tp, pp, te=False)
    got = {}
    for p in conv.params:
        shards = [conv.to_local(p.kind, [want[n] for n in p.hf_names], r) for r in range(tp)]
        assert all(s.shape == shards[0].shape for s in shards)
        got.update(zip(p.hf_names, conv.to_hf(p.kind, shards)))
    assert sorted(got) == sorted(n for n in want if n != "lm_head.weight" or not config.tie_word_embeddings)
    for name, tensor in got.items():
        assert torch.equal(tensor, want[name]), name


def test_fused_qkv_interleaves_q_k_v_per_group_and_splits_contiguously_over_ranks():
    config = hf_config("llama", heads=4, groups=2, layers=1)
    conv = _Converter(config, 2, 1, te=False)
    d = conv.head_dim
    q = torch.arange(4 * d, dtype=torch.float32)[:, None]
    k, v = 1000 + torch.arange(2 * d, dtype=torch.float32)[:, None], 2000 + torch.arange(2 * d, dtype=torch.float32)[:, None]
    # Rank r holds KV group r: its two query heads, then its key head, then its value head.
    for r in range(2):
        shard = conv.to_local("qkv", [q, k, v], r)
        assert torch.equal(shard, torch.cat([q[2 * r * d : 2 * (r + 1) * d], k[r * d : (r + 1) * d], v[r * d : (r + 1) * d]]))


@pytest.mark.parametrize("heads,groups,tp", [(8, 2, 2), (8, 4, 4), (8, 8, 2)])
def test_each_ranks_piece_of_an_hf_tensor_is_its_chunk(heads, groups, tp):
    """What the checkpoint writes as DTensor shards (per_rank().to_hf) is torch.chunk(hf, tp)[rank]."""
    config = hf_config("qwen2", heads, groups, layers=1)
    want = hf_tensors(config)
    conv = _Converter(config, tp, 1, te=False)
    view = conv.per_rank()
    for p in conv.params:
        assert conv.shards_cleanly(p.kind)
        for r in range(tp):
            local = conv.to_local(p.kind, [want[n] for n in p.hf_names], r)
            pieces = view.to_hf(p.kind, [local])
            dim = SHARD_DIM[p.kind]
            for name, piece in zip(p.hf_names, pieces):
                expected = want[name] if dim is None else want[name].chunk(tp, dim)[r]
                assert torch.equal(piece, expected), (name, r)
            assert torch.equal(view.to_local(p.kind, pieces, 0), local)


def test_fewer_kv_groups_than_ranks_is_gathered_not_sharded():
    conv = _Converter(hf_config("qwen2", 8, 1), 2, 1, te=False)
    assert not conv.shards_cleanly("qkv") and conv.shards_cleanly("gate_up")


def test_pipeline_stages_own_contiguous_layers_and_the_ends():
    conv = _Converter(hf_config(layers=4, tied=True), 1, 2, te=False)
    stage = {p.hf_names[0]: (p.stage, p.name) for p in conv.params}
    assert stage["model.embed_tokens.weight"][0] == 0 and stage["model.norm.weight"][0] == 1
    assert stage["model.layers.1.mlp.down_proj.weight"] == (0, "decoder.layers.1.mlp.linear_fc2.weight")
    assert stage["model.layers.2.mlp.down_proj.weight"] == (1, "decoder.layers.0.mlp.linear_fc2.weight")
    # Tied embeddings: the last stage loads its own copy as output layer; it is never gathered.
    assert conv.tied_copy is not None and conv.tied_copy.stage == 1
    assert all(p.name != "output_layer.weight" for p in conv.params)


def test_transformer_engine_names_fuse_the_norms_into_the_linears():
    names = {p.name for p in _Converter(hf_config(layers=1), 1, 1, te=True).params}
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in names
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in names
    assert "decoder.layers.0.input_layernorm.weight" not in names


def test_unsupported_layouts_are_config_errors_naming_the_numbers():
    with pytest.raises(ValueError, match="num_ranks=3 is not a multiple of tensor_parallel"):
        _check_layout(hf_config(), 2, 1, 3)
    with pytest.raises(ValueError, match="4 layers do not split into pipeline_parallel=3"):
        _check_layout(hf_config(), 1, 3, 3)
    with pytest.raises(ValueError, match="3 KV heads and tensor_parallel=2"):
        _check_layout(hf_config(heads=6, groups=3), 2, 1, 2)
    _check_layout(hf_config(heads=8, groups=1), 2, 2, 8)


def test_backend_config_is_a_union_on_type():
    from rlmesh.services.config import ConfigError, load_config

    cfg = load_config(None, ["learner.backend.type=megatron", "learner.backend.tensor_parallel=2"])
    assert (cfg.learner.backend.type, cfg.learner.backend.tensor_parallel, cfg.learner.backend.pipeline_parallel) == (
        "megatron", 2, 1)
    # A partial section keeps the default member.
    assert load_config(None, ["learner.backend.param_dtype=bfloat16"]).learner.backend.type == "fsdp2"
    with pytest.raises(ConfigError, match="learner.backend.tensor_parallel: unknown key"):
        load_config(None, ["learner.backend.tensor_parallel=2"])
    with pytest.raises(ConfigError, match="allowed: param_dtype, pipeline_parallel, tensor_parallel, type"):
        load_config(None, ["learner.backend.type=megatron", "learner.backend.tp=2"])
