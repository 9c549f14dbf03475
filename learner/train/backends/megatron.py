"""Megatron-core training backend: tensor, pipeline and data parallel training of an HF Qwen2 /
Llama model as a Megatron `GPTModel`, with Megatron's DDP and distributed optimizer.

HF in, HF out: every rank reads its own shards of the HF safetensors at start-up (fused QKV and
gate/up split per tensor-parallel rank by `_Converter`), and `full_weights` gathers the shards back
into HF-named full tensors (TP all-gather on the owning pipeline stage, then a broadcast down each
pipeline group), so the weight broadcast and `save_pretrained` see the same names as with FSDP2.

Checkpoints are torch.distributed.checkpoint (DCP) with HF names: each rank writes its TP shard of
every HF tensor (a DTensor over its TP group; data-parallel replicas are deduplicated by DCP) and
the fp32 master weights' Adam moments in the same layout (assembled from the distributed
optimizer's data-parallel shards), so a checkpoint resumes on any tensor/pipeline/data-parallel
layout the model allows, and `rlmesh export` reads its model like an FSDP2 checkpoint's. (Where a
model has fewer KV heads than TP ranks a rank's QKV piece is not a clean shard: those tensors are
gathered and written whole.)

The micro-batches of a step go through megatron-core's pipeline schedule in one call, padded to
one shape; the loss is the objective's (no Megatron copy of it), on the last stage, over logprobs
from vocab-parallel cross entropy. `calculate_per_token_loss` makes Megatron's DDP sum gradients
over data-parallel ranks instead of averaging them: the objective's normalisers already span the
whole step, so the sum is the single-rank gradient.

Transformer Engine's layer spec is used where TE is installed (GPU hosts), the local spec
otherwise; without CUDA `megatron_cpu_shim` lets megatron-core run on CPU over gloo. A single
process (`rlmesh sft`) runs the model unsplit whatever the configured layout."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from rlmesh.learner.train.backends import megatron_cpu_shim
from rlmesh.learner.train.backends.base import LossFn
from rlmesh.learner.train.batch import MicroBatch
from rlmesh.learner.train.distributed import init_distributed
from rlmesh.services.weights.wire import TensorMeta
from rlmesh.services.config import MegatronBackendSection, RolloutSection, default

if TYPE_CHECKING:
    from transformers import PretrainedConfig

log = logging.getLogger(__name__)

# How a Megatron parameter relates to its HF tensors (see `_Converter`).
VOCAB, ROW, REPLICATED, QKV, GATE_UP = "vocab", "row", "replicated", "qkv", "gate_up"


@dataclass(frozen=True)
class _Param:
    """One Megatron parameter of the whole model: where it lives and which HF tensors it holds."""

    name: str  # on its stage, e.g. decoder.layers.0.self_attention.linear_qkv.weight
    stage: int  # pipeline stage that owns it
    kind: str
    hf_names: tuple[str, ...]


class _Converter:
    """HF <-> Megatron layouts for one model and one TP size (pure tensor reshuffles: exact).

    - QKV: Megatron's fused weight interleaves per KV group [q heads of the group; k; v] and is
      split contiguously over TP ranks (with fewer KV groups than ranks, a rank holds part of a
      group and megatron-core all-gathers in the forward).
    - gate/up: each TP rank's fc1 shard is [its gate rows; its up rows].
    - vocab (embedding, lm_head): rows split over TP; row-parallel (o_proj, down_proj): columns."""

    def __init__(self, hf: PretrainedConfig, tp: int, pp: int, te: bool) -> None:
        self.tp, self.pp = tp, pp
        self.num_heads, self.num_groups = hf.num_attention_heads, hf.num_key_value_heads
        self.head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        self.tied = bool(getattr(hf, "tie_word_embeddings", False))
        layers_per_stage = hf.num_hidden_layers // pp
        qkv_bias = hf.model_type == "qwen2" or bool(getattr(hf, "attention_bias", False))
        qkv_norm = "self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight"
        mlp_norm = "mlp.linear_fc1.layer_norm_weight" if te else "pre_mlp_layernorm.weight"
        last = pp - 1
        params = [_Param("embedding.word_embeddings.weight", 0, VOCAB, ("model.embed_tokens.weight",))]
        for i in range(hf.num_hidden_layers):
            stage, pre, hf_pre = i // layers_per_stage, f"decoder.layers.{i % layers_per_stage}.", f"model.layers.{i}."
            attn, mlp = hf_pre + "self_attn.", hf_pre + "mlp."
            params += [
                _Param(pre + qkv_norm, stage, REPLICATED, (hf_pre + "input_layernorm.weight",)),
                _Param(pre + "self_attention.linear_qkv.weight", stage, QKV,
                       tuple(f"{attn}{p}_proj.weight" for p in "qkv")),
            ]
            if qkv_bias:
                params.append(_Param(pre + "self_attention.linear_qkv.bias", stage, QKV,
                                     tuple(f"{attn}{p}_proj.bias" for p in "qkv")))
            params += [
                _Param(pre + "self_attention.linear_proj.weight", stage, ROW, (attn + "o_proj.weight",)),
                _Param(pre + mlp_norm, stage, REPLICATED, (hf_pre + "post_attention_layernorm.weight",)),
                _Param(pre + "mlp.linear_fc1.weight", stage, GATE_UP, (mlp + "gate_proj.weight", mlp + "up_proj.weight")),
                _Param(pre + "mlp.linear_fc2.weight", stage, ROW, (mlp + "down_proj.weight",)),
            ]
        params.append(_Param("decoder.final_layernorm.weight", last, REPLICATED, ("model.norm.weight",)))
        if not self.tied:
            params.append(_Param("output_layer.weight", last, VOCAB, ("lm_head.weight",)))
        self.params = params
        # Tied embeddings across stages: the last stage keeps its own copy of the embedding as
        # output layer (megatron-core all-reduces the two gradients); loaded, never gathered.
        self.tied_copy = (_Param("output_layer.weight", last, VOCAB, ("model.embed_tokens.weight",))
                          if self.tied and pp > 1 else None)

    def to_local(self, kind: str, hf_tensors: list[torch.Tensor], tp_rank: int) -> torch.Tensor:
        """This TP rank's shard of the Megatron parameter made of `hf_tensors`."""
        if kind == REPLICATED:
            return hf_tensors[0]
        if kind == VOCAB:
            return hf_tensors[0].chunk(self.tp, 0)[tp_rank]
        if kind == ROW:
            return hf_tensors[0].chunk(self.tp, 1)[tp_rank]
        if kind == GATE_UP:
            gate, up = hf_tensors
            return torch.cat([gate.chunk(self.tp, 0)[tp_rank], up.chunk(self.tp, 0)[tp_rank]])
        q, k, v = hf_tensors
        g, rest = self.num_groups, q.shape[1:]
        fused = torch.cat([q.reshape(g, -1, *rest), k.reshape(g, -1, *rest), v.reshape(g, -1, *rest)], dim=1)
        return fused.reshape(-1, *rest).chunk(self.tp, 0)[tp_rank]

    def to_hf(self, kind: str, shards: list[torch.Tensor]) -> list[torch.Tensor]:
        """The HF tensors of a Megatron parameter, from its shards on every TP rank (in rank order)."""
        if kind == REPLICATED:
            return [shards[0]]
        if kind in (VOCAB, ROW):
            return [torch.cat(shards, 0 if kind == VOCAB else 1)]
        if kind == GATE_UP:
            halves = [s.chunk(2, 0) for s in shards]
            return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
        fused = torch.cat(shards)
        g, rest, per_group = self.num_groups, fused.shape[1:], self.num_heads // self.num_groups
        q, k, v = fused.reshape(g, -1, *rest).split([per_group * self.head_dim, self.head_dim, self.head_dim], dim=1)
        return [t.reshape(-1, *rest).contiguous() for t in (q, k, v)]

    def per_rank(self) -> _Converter:
        """The layout of one TP rank's shard as a model of its own (tp=1, heads / tp): its
        `to_hf` splits a rank's shard into that rank's pieces of the HF tensors, and its
        `to_local` fuses them back. Valid where every rank holds whole KV groups."""
        view = _Converter.__new__(_Converter)
        view.tp, view.pp, view.tied, view.head_dim = 1, 1, self.tied, self.head_dim
        view.num_heads, view.num_groups = self.num_heads // self.tp, self.num_groups // self.tp
        view.params = []
        return view

    def shards_cleanly(self, kind: str) -> bool:
        """Whether each TP rank's piece of this parameter's HF tensors is a torch.chunk-style
        shard (false for QKV with fewer KV groups than TP ranks: a rank holds part of a group)."""
        return kind != QKV or self.num_groups % self.tp == 0


# Dimension along which a TP rank's piece of an HF tensor is a shard (None: replicated).
SHARD_DIM = {VOCAB: 0, ROW: 1, GATE_UP: 0, QKV: 0, REPLICATED: None}


def _hf_config(model_path: str) -> PretrainedConfig:
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_path)
    if hf.model_type not in ("qwen2", "llama"):
        raise ValueError(f"learner.backend.type=megatron loads Qwen2 and Llama models; {model_path} is "
                         f"{hf.model_type!r} (use learner.backend.type=fsdp2)")
    rope = getattr(hf, "rope_parameters", None) or {"rope_type": "default"}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"{model_path}: rope scaling {rope.get('rope_type')!r} is not supported by the "
                         "Megatron backend's converter (use learner.backend.type=fsdp2)")
    return hf


def _read_hf_tensors(model_path: str, names: set[str]) -> dict[str, torch.Tensor]:
    """The named tensors from an HF directory's safetensors files, reading nothing else."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for file in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in names.intersection(f.keys()):
                out[name] = f.get_tensor(name)
    missing = names - out.keys()
    if missing:
        raise ValueError(f"{model_path}: safetensors lack {sorted(missing)[:4]} (an HF Qwen2/Llama directory is needed)")
    return out


class MegatronBackend:
    # Its pipeline schedule reduces gradients over ranks once per call (finalize_model_grads): a step trains whole.
    streams = False

    def __init__(self, model_path: str, *, tensor_parallel: int, pipeline_parallel: int, lr: float,
                 weight_decay: float, max_grad_norm: float, param_dtype: str = default(MegatronBackendSection, "param_dtype"), seed: int = 0) -> None:
        self.rank, self.world_size = init_distributed()
        tp, pp = tensor_parallel, pipeline_parallel
        if self.world_size == 1 and tp * pp > 1:
            # A single process (`rlmesh sft`, the warm start `rlmesh up` runs before the learner
            # job) cannot split the model; it trains it whole, which is the same computation.
            log.warning("megatron backend in a single process: tensor_parallel=%d pipeline_parallel=%d apply "
                        "under torchrun only; running unsplit", tp, pp)
            tp = pp = 1
        hf = _hf_config(model_path)
        _check_layout(hf, tp, pp, self.world_size)
        megatron_cpu_shim.activate()
        with self._mode():
            self._build(hf, model_path, tp, pp, lr=lr, weight_decay=weight_decay, max_grad_norm=max_grad_norm,
                        param_dtype=getattr(torch, param_dtype), seed=seed)

    def _build(self, hf: PretrainedConfig, model_path: str, tp: int, pp: int, *, lr: float, weight_decay: float,
               max_grad_norm: float, param_dtype: torch.dtype, seed: int) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_local_spec,
            get_gpt_layer_with_transformer_engine_spec,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer import TransformerConfig

        if ps.model_parallel_is_initialized() and (ps.get_tensor_model_parallel_world_size(),
                                                   ps.get_pipeline_model_parallel_world_size()) != (tp, pp):
            ps.destroy_model_parallel()
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        torch.manual_seed(seed)
        self.tp_rank, self.pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.tp, self.pp = tp, pp
        self.tp_group, self.pp_group, self.dp_group = (ps.get_tensor_model_parallel_group(),
                                                       ps.get_pipeline_model_parallel_group(),
                                                       ps.get_data_parallel_group())
        self.pp_ranks = dist.get_process_group_ranks(self.pp_group)
        self.is_last_stage = ps.is_pipeline_last_stage()
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        te = torch.cuda.is_available() and _have_te()
        self.conv = _Converter(hf, tp, pp, te)
        self.param_dtype = param_dtype
        rope = getattr(hf, "rope_parameters", None) or {}
        config = TransformerConfig(
            num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size, ffn_hidden_size=hf.intermediate_size,
            num_attention_heads=hf.num_attention_heads, num_query_groups=hf.num_key_value_heads,
            kv_channels=self.conv.head_dim, normalization="RMSNorm", layernorm_epsilon=hf.rms_norm_eps,
            gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
            add_qkv_bias=any(p.name.endswith("linear_qkv.bias") for p in self.conv.params),
            hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp, params_dtype=param_dtype, pipeline_dtype=param_dtype,
            bf16=param_dtype == torch.bfloat16,
            # Initialised, then overwritten from the HF weights: megatron-core marks tensor-parallel
            # weights (which the grad norm counts once per TP rank) only when it initialises them.
            perform_initialization=True,
            # The objective's loss is already normalised over the whole step: sum, never average.
            calculate_per_token_loss=True)
        spec = get_gpt_layer_with_transformer_engine_spec() if te else get_gpt_layer_local_spec(normalization="RMSNorm")
        model = GPTModel(config, spec, vocab_size=hf.vocab_size, max_sequence_length=hf.max_position_embeddings,
                         pre_process=ps.is_pipeline_first_stage(), post_process=self.is_last_stage,
                         share_embeddings_and_output_weights=self.conv.tied, position_embedding_type="rope",
                         rotary_base=int(rope.get("rope_theta", getattr(hf, "rope_theta", 10000))),
                         parallel_output=True)
        model.to(self.device)
        self.params = dict(model.named_parameters())
        self._load_hf(model_path)
        self.model = DistributedDataParallel(config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=True, overlap_grad_reduce=False), model)
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=lr, weight_decay=weight_decay, adam_beta1=0.9, adam_beta2=0.999,
                            adam_eps=1e-8, clip_grad=max_grad_norm, bf16=param_dtype == torch.bfloat16,
                            params_dtype=param_dtype, use_distributed_optimizer=True),
            [self.model], config_overrides={})  # {}: weight decay on every parameter, as FSDP2's AdamW
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            hf_meta = AutoModelForCausalLM.from_config(hf)
        self.hf_config = hf
        self.hf_shapes = {n: tuple(t.shape) for n, t in hf_meta.state_dict().items()}

    @staticmethod
    def _mode() -> contextlib.AbstractContextManager:
        return megatron_cpu_shim.cpu_device_mode()

    def _local_params(self) -> list[_Param]:
        mine = [p for p in self.conv.params if p.stage == self.pp_rank]
        if self.conv.tied_copy is not None and self.is_last_stage:
            mine.append(self.conv.tied_copy)
        return mine

    def _load_hf(self, model_path: str) -> None:
        mine = self._local_params()
        hf = _read_hf_tensors(model_path, {n for p in mine for n in p.hf_names})
        with torch.no_grad():
            for p in mine:
                local = self.conv.to_local(p.kind, [hf[n] for n in p.hf_names], self.tp_rank)
                self.params[p.name].copy_(local)
        assert {p.name for p in mine} == set(self.params), sorted(set(self.params) ^ {p.name for p in mine})

    # --- forward / backward through megatron-core's pipeline schedules -----------------------------

    def _schedule(self, micros: list[MicroBatch], temperature: float, forward_only: bool, on_logprobs) -> None:
        """Run `micros` through the model in one schedule call (pipelined over stages); on the last
        stage `on_logprobs(micro, logprobs_BT)` turns each micro-batch's logprobs into its loss.
        Micro-batches are right-padded to one shape, which pipeline send/recv needs."""
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        b = max(m.input_ids_BT.shape[0] for m in micros)
        t = max(m.input_ids_BT.shape[1] for m in micros)
        padded = []
        for m in micros:
            ids = torch.zeros((b, t), dtype=torch.long)
            ids[: m.input_ids_BT.shape[0], : m.input_ids_BT.shape[1]] = m.input_ids_BT
            padded.append((m, ids.to(self.device)))
        positions = torch.arange(t, device=self.device).expand(b, t)

        def loss_func(micro: MicroBatch, logits_BTV: torch.Tensor):
            mb, mt = micro.input_ids_BT.shape
            # Causal attention with right padding: the real tokens' logits ignore the padding.
            # A new float32 tensor either way: Megatron's vocab-parallel cross entropy views its input and
            # subtracts the row maximum from it in place (the model's own logits must stay as they are).
            real_BTV = logits_BTV[:mb, : mt - 1]
            logits = (real_BTV.float() / temperature if temperature != 1.0 else
                      real_BTV.to(torch.float32, memory_format=torch.contiguous_format, copy=True))
            targets = micro.input_ids_BT[:, 1:].to(self.device)
            logprobs_BT = -vocab_parallel_cross_entropy(logits, targets)
            return on_logprobs(micro, logprobs_BT), torch.tensor(1, dtype=torch.int), {}

        def forward_step(data_iterator, model):
            micro, ids = next(data_iterator)
            return model(ids, positions, None), partial(loss_func, micro)

        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(padded), model=[self.model],
                                    num_microbatches=len(padded), seq_length=t, micro_batch_size=b,
                                    forward_only=forward_only)

    @torch.no_grad()
    def compute_logprobs(self, micro: MicroBatch, temperature: float = default(RolloutSection, "temperature")) -> torch.Tensor:
        self.model.eval()
        out = torch.empty((micro.input_ids_BT.shape[0], micro.input_ids_BT.shape[1] - 1), device=self.device)

        def keep(_, logprobs_BT):
            out.copy_(logprobs_BT)
            return logprobs_BT.new_zeros(())

        with self._mode():
            self._schedule([micro], temperature, True, keep)
            if self.pp > 1:  # only the last stage has logits; every rank returns the logprobs
                dist.broadcast(out, src=self.pp_ranks[-1], group=self.pp_group)
        return out.cpu()

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def train_step(self, micros: list[MicroBatch], loss_fn: LossFn, temperature: float = default(RolloutSection, "temperature")) -> dict[str, float]:
        from megatron.core.distributed import finalize_model_grads

        self.model.train()
        seen: list[tuple[bool, float, dict[str, float]]] = []

        def loss(micro, logprobs_BT):
            # Batch tensors live on CPU; the loss is computed there (a no-op move on CPU hosts).
            value, metrics = loss_fn(logprobs_BT.cpu(), micro)
            seen.append((micro.is_padding, float(value.detach()), metrics))
            return value

        with self._mode():
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            self._schedule(micros, temperature, False, loss)
            # Sum (not average) over data-parallel ranks: each rank's loss carries the whole step's
            # normalisers, so the sum is the single-rank gradient. Also syncs tied embeddings.
            finalize_model_grads([self.model])
            _, grad_norm, _ = self.optimizer.step()
        # The loss exists on the last stage, once per TP group: count it from TP rank 0 only.
        mine = seen if self.tp_rank == 0 else []
        gathered: list[list] = [[] for _ in range(self.world_size)]
        dist.all_gather_object(gathered, mine)
        flat = [s for rank in gathered for s in rank]
        num_real = sum(1 for padding, _, _ in flat if not padding)
        sums: dict[str, float] = {}
        for padding, _, metrics in flat:
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + (0.0 if padding else v)
        out = {k: v / max(num_real, 1) for k, v in sorted(sums.items())}
        out["loss"] = sum(value for _, value, _ in flat)
        out["grad_norm"] = float(grad_norm)
        return out

    # --- HF-named weights out ------------------------------------------------------------------------

    def weight_metas(self) -> list[TensorMeta]:
        dtype = str(self.param_dtype).removeprefix("torch.")
        return [TensorMeta(name, dtype, self.hf_shapes[name]) for name in self._hf_order()]

    def _hf_order(self) -> list[str]:
        names = [n for p in self.conv.params for n in p.hf_names]
        if self.conv.tied and "lm_head.weight" in self.hf_shapes:
            names.insert(1, "lm_head.weight")
        return names

    def _gather_tp(self, local: torch.Tensor) -> list[torch.Tensor]:
        if self.tp == 1:
            return [local]
        shards = [torch.empty_like(local) for _ in range(self.tp)]
        dist.all_gather(shards, local.contiguous(), group=self.tp_group)
        return shards

    def full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        # One Megatron parameter at a time: its stage gathers the TP shards into HF tensors, then
        # each pipeline group broadcasts them from that stage, so every rank yields every tensor.
        for p in self.conv.params:
            with self._mode():
                if p.stage == self.pp_rank:
                    local = self.params[p.name].detach()
                    shards = [local] if p.kind == REPLICATED else self._gather_tp(local)
                    tensors = self.conv.to_hf(p.kind, shards)
                else:
                    tensors = [torch.empty(self.hf_shapes[n], dtype=self.param_dtype, device=self.device)
                               for n in p.hf_names]
                if self.pp > 1:
                    for t in tensors:
                        dist.broadcast(t, src=self.pp_ranks[p.stage], group=self.pp_group)
            for name, t in zip(p.hf_names, tensors):
                yield name, t
                if name == "model.embed_tokens.weight" and self.conv.tied and "lm_head.weight" in self.hf_shapes:
                    yield "lm_head.weight", t

    def save_pretrained(self, path: str) -> None:
        from transformers import AutoModelForCausalLM

        state = {n: t.cpu() for n, t in self.full_weights()}
        if self.rank == 0:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(self.hf_config)
            model.save_pretrained(path, state_dict=state, safe_serialization=True)

    # --- checkpoints: DCP with HF names, resumable on any layout ------------------------------------

    def _optimizer_for(self, param: torch.nn.Parameter):
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            if param in opt.model_param_group_index_map:
                return opt
        return None  # this data-parallel rank holds no part of `param`

    def _adam_groups(self) -> Iterator[tuple[torch.optim.Optimizer, dict]]:
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            for group in opt.optimizer.param_groups:
                yield opt.optimizer, group

    def _ensure_adam_state(self) -> torch.Tensor:
        """Adam's state exists from the first step on; before it, zeros at step 0 (the same update).
        Returns the step count, agreed over all ranks (a rank may hold no part of any parameter).
        torch's AdamW keeps the step per parameter, fused Adams (TE, apex) per group."""
        step = 0.0
        for inner, group in self._adam_groups():
            for main in group["params"]:
                state = inner.state[main]
                if "exp_avg" not in state:
                    state.update(exp_avg=torch.zeros_like(main), exp_avg_sq=torch.zeros_like(main))
                    if isinstance(inner, torch.optim.AdamW):
                        state["step"] = torch.tensor(0.0)
                step = max(step, float(state["step"]) if "step" in state else float(group.get("step", 0)))
        agreed = torch.tensor(step, device=self.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        return agreed.cpu()

    def _set_group_step(self, step: torch.Tensor) -> None:
        for inner, group in self._adam_groups():
            if not isinstance(inner, torch.optim.AdamW):
                group["step"] = int(step)

    def _dp_assembled(self, param: torch.nn.Parameter, key: str) -> torch.Tensor:
        """This TP rank's whole `param` (fp32 main copy) or Adam moment `key`, from the distributed
        optimizer's data-parallel shards."""
        flat = torch.zeros(param.numel(), dtype=torch.float32, device=self.device)
        opt = self._optimizer_for(param)
        if opt is not None:
            r = opt._get_model_param_range_map(param)["param"]
            flat[r.start : r.end] = opt._get_main_param_and_optimizer_states(param)[key].view(-1)
        if self.dp_size > 1:
            dist.all_reduce(flat, group=self.dp_group)
        return flat.view(param.shape)

    def _dcp_state(self) -> tuple[dict, list[tuple[_Param, dict[str, list]]]]:
        """The state DCP saves or loads: {"model": {hf_name: t}, "optimizer": {"state": {hf_name:
        {"step", "exp_avg", "exp_avg_sq"}}}}, each rank holding its TP shards as DTensors; and, per
        local parameter, the tensors in it (to copy back after a load)."""
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor, Shard

        mesh = DeviceMesh.from_group(self.tp_group, device_type=self.device.type)
        step = self._ensure_adam_state()
        per_rank = self.conv.per_rank()
        model, optim, entries = {}, {}, []
        for p in self._local_params():
            param = self.params[p.name]
            values: dict[str, list] = {}
            for key in ("param", "exp_avg", "exp_avg_sq"):
                local = self._dp_assembled(param, key)
                if not self.conv.shards_cleanly(p.kind):
                    values[key] = self.conv.to_hf(p.kind, self._gather_tp(local))
                    continue
                dim = SHARD_DIM[p.kind]
                values[key] = [
                    piece if dim is None else DTensor.from_local(
                        piece.contiguous(), mesh, [Shard(dim)], run_check=False, shape=torch.Size(self.hf_shapes[n]),
                        stride=torch.empty(self.hf_shapes[n], device="meta").stride())
                    for n, piece in zip(p.hf_names, per_rank.to_hf(p.kind, [local]))]
            entries.append((p, values))
            for i, name in enumerate(p.hf_names):
                aliases = [name]
                if name == "model.embed_tokens.weight" and self.conv.tied and "lm_head.weight" in self.hf_shapes:
                    aliases.append("lm_head.weight")  # HF state dicts (and `rlmesh export`) name both
                for alias in aliases:
                    model[alias] = values["param"][i]
                optim[name] = {"step": step, "exp_avg": values["exp_avg"][i], "exp_avg_sq": values["exp_avg_sq"][i]}
        return {"model": model, "optimizer": {"state": optim}}, entries

    def save_checkpoint(self, path: Path) -> None:
        import torch.distributed.checkpoint as dcp

        with self._mode():
            state, _ = self._dcp_state()
            dcp.save(state, checkpoint_id=str(path))

    def load_checkpoint(self, path: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.tensor import DTensor

        with self._mode():
            state, entries = self._dcp_state()
            dcp.load(state, checkpoint_id=str(path))
            steps = [v["step"] for v in state["optimizer"]["state"].values()]
            step = steps[0].to(self.device)
            dist.all_reduce(step, op=dist.ReduceOp.MAX)  # the same on every rank, as saved
            step = step.cpu()
            self._set_group_step(step)
            per_rank = self.conv.per_rank()
            for p, values in entries:
                param = self.params[p.name]
                local = {}
                for key, tensors in values.items():
                    tensors = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
                    local[key] = (per_rank.to_local(p.kind, tensors, 0) if self.conv.shards_cleanly(p.kind)
                                  else self.conv.to_local(p.kind, tensors, self.tp_rank))
                opt = self._optimizer_for(param)
                with torch.no_grad():
                    param.copy_(local["param"])
                    if opt is not None:
                        r = opt._get_model_param_range_map(param)["param"]
                        opt._set_main_param_and_optimizer_states(param, {
                            "step": step, **{k: v.reshape(-1)[r.start : r.end] for k, v in local.items()}})


def _have_te() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def _check_layout(hf: PretrainedConfig, tp: int, pp: int, world_size: int) -> None:
    """Layouts megatron-core and the converter support, as config errors naming the fix."""
    problems = []
    if world_size % (tp * pp):
        problems.append(f"learner.num_ranks={world_size} is not a multiple of tensor_parallel * pipeline_parallel "
                        f"= {tp * pp}")
    if hf.num_hidden_layers % pp:
        problems.append(f"the model's {hf.num_hidden_layers} layers do not split into pipeline_parallel={pp} stages")
    for what, n in (("vocab size", hf.vocab_size), ("attention heads", hf.num_attention_heads),
                    ("intermediate size", hf.intermediate_size)):
        if n % tp:
            problems.append(f"the model's {what} {n} is not divisible by tensor_parallel={tp}")
    groups = hf.num_key_value_heads
    if groups % tp and tp % groups:
        problems.append(f"the model's {groups} KV heads and tensor_parallel={tp}: one must divide the other")
    if problems:
        raise ValueError("learner.backend (megatron): " + "; ".join(problems))
