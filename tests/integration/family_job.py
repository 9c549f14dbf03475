"""One process of the family matrix (tests/integration/test_model_families.py): for each family named, a
tiny random-init model served by vLLM in this process, checked against the HF model, updated through
rlmesh's gloo path and read back; one `ROW <json>` line per family and dtype on stdout.
Run: python tests/integration/family_job.py OUT FAMILY[:tied|:untied] ..."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

DTYPES = ("float32", "bfloat16")
REFUSED_ARCHS = ("qwen2_moe", "qwen3_moe", "mixtral", "olmo2")
"""Families refused by rlmesh.services.model_families (checked here to fail loudly when updated)."""


def _token_batches(vocab: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (24,), generator=g).tolist() for _ in range(4)]


def _hf_logprobs(hf, seqs: list[list[int]]) -> list[list[float]]:
    import torch

    out = []
    with torch.no_grad():
        for ids in seqs:
            logits = hf(torch.tensor([ids])).logits[0].float()
            lp = torch.log_softmax(logits, -1)
            out.append([lp[i - 1, ids[i]].item() for i in range(1, len(ids))])
    return out


def _vllm_logprobs(llm, seqs: list[list[int]]) -> list[list[float]]:
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": ids} for ids in seqs],
                        SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0), use_tqdm=False)
    return [[o.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))] for o, ids in zip(outs, seqs)]


def mismatch(llm, hf, seqs: list[list[int]]) -> dict[str, float]:
    """rlmesh's mismatch_kl (k3 estimate of KL(vLLM || HF) on the tokens) and the largest |difference|."""
    import math

    kl, worst, n = 0.0, 0.0, 0
    for a, b in zip(_vllm_logprobs(llm, seqs), _hf_logprobs(hf, seqs)):
        for x, y in zip(a, b):
            d = x - y
            kl += math.exp(-d) - 1 + d
            worst = max(worst, abs(d))
            n += 1
    return {"kl": kl / n, "max_abs": worst}


GREEDY_PROMPTS = ("1+2=", "hello", "9*9=")
"""Chat prompts each family answers greedily, 8 tokens, in HF and in vLLM (float32): the same tokens, and vLLM's
text is their text."""


def greedy(llm, hf, tok) -> dict[str, list]:
    """Greedy answers to GREEDY_PROMPTS through the tokenizer's chat template: HF's `generate` (`want`) and
    vLLM's (`got`, its `text`, and the tokenizer's decoding of its tokens)."""
    import torch
    from vllm import SamplingParams

    prompts = [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=True,
                                       return_dict=False) for c in GREEDY_PROMPTS]
    want = []
    with torch.no_grad():
        for ids in prompts:
            out = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=tok.eos_token_id,
                              pad_token_id=tok.pad_token_id)
            want.append(out[0, len(ids):].tolist())
    outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                               SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)]
    return {"want": want, "got": [list(o.token_ids) for o in outs], "text": [o.text for o in outs],
            "decoded": [tok.decode(o.token_ids, skip_special_tokens=True) for o in outs],
            "finish": [o.finish_reason for o in outs]}


def perturb(hf, seed: int) -> None:
    """The learner's step: every parameter moves (matrices by a noise of 0.05, vectors by 0.2), so a
    layer whose reload failed serves visibly old weights."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=g) * (0.05 if p.ndim > 1 else 0.2))


def learner_stream(hf, dtype: str) -> list[tuple[str, object]]:
    """What the learner's Trainer sends: the HF model's state-dict tensors (transformers' in-memory names),
    a tied output layer once (as the embedding), cast to the served dtype; the HF model then holds exactly
    the sent values (bf16-rounded), so the logprob check sees vLLM's arithmetic, not the rounding."""
    import torch

    tied = bool(getattr(hf.config, "tie_word_embeddings", False))
    wire = getattr(torch, dtype)
    named = [(n, t.detach().to(wire).contiguous()) for n, t in hf.state_dict().items()
             if not (tied and n == "lm_head.weight")]
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.to(wire).float())
    return named


def weight_loaders(llm) -> dict[str, str]:
    """Each served parameter's weight loader, by name, and each plain weight's the direct load keeps
    for a linear layer (`staged:<layer>`): an update must leave them as it found them."""
    worker = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
    plan = getattr(worker.weight_transfer_engine, "_direct", None)
    named = [*worker.model_runner.model.named_parameters(),
             *((f"staged:{id(layer)}", w) for layer, w in getattr(plan, "_staged", {}).items())]
    out = {}
    for name, param in named:
        loader = getattr(param, "weight_loader", None)
        out[name] = "" if loader is None else f"{getattr(loader, '__qualname__', type(loader).__name__)}@{id(loader)}"
    return out


def partial_drop(named: list) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Two tensors an update leaves out -> (the served layer that must then be named as not reloaded, the
    HF tensors that layer serves): a whole layer (layer 0's attention output) and one shard of a fused
    layer (layer 1's k_proj, where the family sends q, k and v apart; Phi-3 sends them fused, so there
    its layer 1 MLP output)."""
    names = {n for n, _ in named}
    attn = "model.layers.1.self_attn."
    out = {"model.layers.0.self_attn.o_proj.weight": ("model.layers.0.self_attn.o_proj",
                                                      ("model.layers.0.self_attn.o_proj.",))}
    if f"{attn}k_proj.weight" in names:
        out[f"{attn}k_proj.weight"] = (f"{attn}qkv_proj", (f"{attn}q_proj.", f"{attn}k_proj.", f"{attn}v_proj."))
    else:
        mlp = "model.layers.1.mlp.down_proj"
        out[f"{mlp}.weight"] = (mlp, (f"{mlp}.",))
    assert set(out) <= names, f"the stream has none of {sorted(set(out) - names)}"
    return out


def broadcast(llm, named: list, version: int) -> dict:
    """One update through rlmesh's real gloo path: GlooSender (rank 0, on a thread) -> the vLLM
    worker's GlooWeightTransferEngine (rank 1) via collective_rpc, as the rollout server drives it."""
    import threading

    from rlmesh.services.config import WeightSyncSection
    from rlmesh.services.weights.gloo import GlooReceiver, GlooSender
    from rlmesh.services.weights.wire import describe, installed_digests
    from rlmesh.v1 import rollout_pb2

    cfg = WeightSyncSection(timeout_s=60)
    algorithm = installed_digests()[0]
    sender, receiver = GlooSender(cfg), GlooReceiver(cfg)
    ticket = sender.rendezvous(1)
    result: dict = {}

    def on_thread(fn, *args):
        def run():
            try:
                result[fn.__name__] = fn(*args)
            except BaseException as err:  # surfaced below
                result["error"] = err
        t = threading.Thread(target=run)
        t.start()
        return t

    t = on_thread(sender.form_group, 1, 2)
    init = rollout_pb2.InitWeightTransferRequest(
        backend="gloo", master_address=ticket.master_address, master_port=ticket.master_port, rank_offset=1,
        world_size=2, group_epoch=1, timeout_seconds=60, group_prefix=ticket.prefix, group_secret=ticket.secret)
    llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": receiver.init_info(init)})
    t.join()
    metas = describe(named)
    request = rollout_pb2.UpdateWeightsRequest(
        version=version, group_epoch=1, digest_algorithm=algorithm,
        tensors=[rollout_pb2.TensorSpec(name=m.name, dtype=m.dtype, shape=m.shape) for m in metas])
    t = on_thread(sender.send, named, metas, algorithm)
    update_error, received = None, None
    try:
        llm.collective_rpc("rlmesh_start_and_update_weights", kwargs={"update_info": receiver.update_info(request)})
        received = [r["digest"] for r in llm.collective_rpc("rlmesh_finish_weight_update")]
    except Exception as err:  # the update failed: what the rollout server would answer UpdateWeights with
        update_error = f"{type(err).__name__}: {err}"
    t.join()
    if "error" in result:
        raise result["error"]
    if received is None:
        received = llm.collective_rpc("rlmesh_received_digest")
    served = llm.collective_rpc("rlmesh_served_check")[0]
    sender.close()
    return {"sent": result.get("send", ""), "received": received, "served": served, "error": update_error}


def run_family(arch: str, tied: bool, out: Path, seed: int = 3) -> list[dict]:
    import gc

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM

    from rlmesh.learner.devtools.tiny_model import write_tiny_model
    from rlmesh.services.config import TinyModelSection

    path = write_tiny_model(TinyModelSection(arch=arch), out / f"{arch}-{'tied' if tied else 'untied'}", seed=seed,
                            tie_word_embeddings=tied)
    rows = []
    # A family rlmesh refuses is shown failing once (float32); the rest run in both dtypes.
    for dtype in DTYPES if arch not in REFUSED_ARCHS else DTYPES[:1]:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        if dtype != "float32":  # the served model's own weights, as the HF reference computes with them
            with torch.no_grad():
                for p in hf.parameters():
                    p.copy_(p.to(getattr(torch, dtype)).float())
        seqs = _token_batches(hf.config.vocab_size, seed)
        row = {"family": arch, "architecture": hf.config.architectures[0], "tied": tied, "dtype": dtype}
        t0 = time.monotonic()
        llm = LLM(str(path), dtype=dtype, enforce_eager=True, max_model_len=64, enable_prefix_caching=False, seed=0,
                  weight_transfer_config={"backend": "rlmesh_gloo"},
                  worker_extension_cls="rlmesh.rollout_server.weight_engine.WorkerDigests")
        row["load_s"] = round(time.monotonic() - t0, 2)
        try:
            row["step0"] = mismatch(llm, hf, seqs)
            if dtype == "float32":
                row["greedy"] = greedy(llm, hf, AutoTokenizer.from_pretrained(path))
            perturb(hf, seed + 1)
            named = learner_stream(hf, dtype)
            t0 = time.monotonic()
            row["update"] = broadcast(llm, named, version=1)
            row["update_s"] = round(time.monotonic() - t0, 2)
            loaders = weight_loaders(llm)  # (the direct load's plain weights exist from the first update on)
            row["step1"] = mismatch(llm, hf, seqs)
            if dtype == "float32" and arch not in REFUSED_ARCHS:
                # New weights short of two layers' tensors: the update must fail naming both layers,
                # which keep serving their old weights whole while every other layer serves the new.
                served_before = {n: t.clone() for n, t in hf.state_dict().items()}
                perturb(hf, seed + 2)
                named = learner_stream(hf, dtype)
                dropped = partial_drop(named)
                row["partial"] = {"dropped": {n: layer for n, (layer, _) in dropped.items()},
                                  "update": broadcast(llm, [(n, t) for n, t in named if n not in dropped], version=2)}
                with torch.no_grad():  # the HF reference: what the server should serve now
                    for n, p in hf.state_dict().items():
                        if any(n.startswith(prefix) for _, prefixes in dropped.values() for prefix in prefixes):
                            p.copy_(served_before[n])
                row["partial"]["after"] = mismatch(llm, hf, seqs)
            after = weight_loaders(llm)
            row["loaders_changed"] = sorted(n for n in set(loaders) | set(after) if loaders.get(n) != after.get(n))
        except Exception as err:
            row["error"] = f"{type(err).__name__}: {err}"
        finally:
            del llm
            gc.collect()
        rows.append(row)
        print("ROW " + json.dumps(row), flush=True)
    return rows


def register_in_process(archs: list[str]) -> None:
    """Import the model classes here: otherwise vLLM inspects each architecture it has not cached
    (~/.cache/vllm/modelinfos) in a fresh subprocess that imports vLLM again (20-55 s a family on a
    busy core in CI)."""
    import importlib

    from vllm import ModelRegistry
    from vllm.model_executor.models.registry import _VLLM_MODELS

    for arch in archs:
        module, name = _VLLM_MODELS[arch]
        ModelRegistry.register_model(arch, getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), name))


ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "gemma3": "Gemma3ForCausalLM", "mistral": "MistralForCausalLM", "phi3": "Phi3ForCausalLM",
                 "olmo2": "Olmo2ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "mixtral": "MixtralForCausalLM"}


def main(argv: list[str]) -> None:
    out = Path(argv[0])
    register_in_process([ARCHITECTURES[a.partition(":")[0]] for a in argv[1:]])
    out.mkdir(parents=True, exist_ok=True)
    for item in argv[1:]:
        arch, _, tying = item.partition(":")
        run_family(arch, tying == "tied", out)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("RLMESH_VERIFY_SERVED_WEIGHTS", "1")
    main(sys.argv[1:])
