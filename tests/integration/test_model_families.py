"""Which model families survive rlmesh's weight path into vLLM-CPU: for each family a tiny random-init
model is served by vLLM, its logprobs are checked against the HF model's (step 0), the "learner"
changes every weight and broadcasts them through rlmesh's own gloo transport and weight engine
(GlooSender -> GlooReceiver -> GlooWeightTransferEngine's layerwise reload), the weights vLLM serves
afterwards are read back and checked against a fresh load of the same weights through vLLM's own
loader (`RLMESH_VERIFY_SERVED_WEIGHTS`), and the logprobs are checked again, in float32 and bf16.

Time: the families run in two processes side by side (one per core), each holding vLLM's engine in
process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) and starting a fresh `LLM` per family and dtype; with
the hub offline (`HF_HUB_OFFLINE=1`: nothing can be downloaded here, and without it each start waits
out hub look-ups) a start is 2-4 s instead of ~20 s. The table (family, tied, load s, mismatch,
verified) is printed (`-s`) and written to `families.json` under the test's tmp dir.

Run as a script (`python tests/integration/test_model_families.py OUT FAMILY[:tied|:untied] ...`)
it is one of those processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# (tiny-model arch, tied output layer) in the matrix: every family the rollout server supports
# (rlmesh.services.model_families), each with its usual tying, and Llama both ways (SmolLM2 ties).
MATRIX = (
    ("qwen2", False), ("llama", False), ("llama", True), ("qwen3", True), ("gemma3", True), ("mistral", False),
    ("phi3", False), ("qwen2_moe", False), ("qwen3_moe", False), ("mixtral", False),
)
DTYPES = ("float32", "bfloat16")
MAX_KL = {"float32": 1e-6, "bfloat16": 5e-3}
"""Bound on the k3 KL estimate (rlmesh's mismatch_kl) between vLLM's and the HF model's logprobs of the
same tokens. float32 measured <= ~1e-9; bf16 (vLLM computes in bf16, HF in float32 on the same
bf16-rounded weights) ~1e-4. A layer left at its old weights after the update gives ~1e-2 and more."""
MAX_ABS = {"float32": 1e-3, "bfloat16": 0.25}
"""Bound on the largest |logprob difference| of any one token."""


# --- the job (one process, several families) ------------------------------------------------------

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
    llm.collective_rpc("start_weight_update")
    t = on_thread(sender.send, named, metas, algorithm)
    update_error = None
    try:
        llm.collective_rpc("update_weights", kwargs={"update_info": receiver.update_info(request)})
        llm.collective_rpc("finish_weight_update")
    except Exception as err:  # the update failed: what the rollout server would answer UpdateWeights with
        update_error = f"{type(err).__name__}: {err}"
    t.join()
    if "error" in result:
        raise result["error"]
    received = llm.collective_rpc("rlmesh_received_digest")
    served = llm.collective_rpc("rlmesh_served_check")[0]
    sender.close()
    return {"sent": result.get("send", ""), "received": received, "served": served, "error": update_error}


def run_family(arch: str, tied: bool, out: Path, seed: int = 3) -> list[dict]:
    import gc

    import torch
    from transformers import AutoModelForCausalLM
    from vllm import LLM

    from rlmesh.learner.devtools.tiny_model import write_tiny_model
    from rlmesh.services.config import TinyModelSection

    path = write_tiny_model(TinyModelSection(arch=arch), out / f"{arch}-{'tied' if tied else 'untied'}", seed=seed,
                            tie_word_embeddings=tied)
    rows = []
    for dtype in DTYPES:
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
            perturb(hf, seed + 1)
            named = learner_stream(hf, dtype)
            t0 = time.monotonic()
            row["update"] = broadcast(llm, named, version=1)
            row["update_s"] = round(time.monotonic() - t0, 2)
            row["step1"] = mismatch(llm, hf, seqs)
        except Exception as err:
            row["error"] = f"{type(err).__name__}: {err}"
        finally:
            del llm
            gc.collect()
        rows.append(row)
        print("ROW " + json.dumps(row), flush=True)
    return rows


def main(argv: list[str]) -> None:
    out = Path(argv[0])
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
