"""The GPU check's results: `OUT/results.json` and `OUT/results.md` from what `bench/gpu_throughput.py`'s
parts wrote under `OUT/parts/` and the exit status of each (`OUT/parts/status.tsv`, from
`bench/gpu_check.sh`), with MFU against the measured bf16 matmul peak and the datasheet's.
Run: python bench/gpu_report.py --out OUT [--cpu-smoke]"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.gpu_throughput import Shape, shape_for  # noqa: E402

# Datasheet dense bf16 peaks (no sparsity), for a second MFU beside the measured peak's.
DATASHEET_BF16 = {"H100 80GB HBM3": 989.4e12, "H100 SXM": 989.4e12, "H100 NVL": 835.6e12, "H100 PCIe": 756.5e12,
                  "H200": 989.4e12, "A100": 312e12}


def read_parts(out: Path) -> tuple[dict, dict]:
    parts = {p.stem: json.loads(p.read_text()) for p in sorted((out / "parts").glob("*.json"))}
    status = {}
    status_file = out / "parts" / "status.tsv"
    if status_file.exists():
        for line in status_file.read_text().splitlines():
            name, rc, seconds = line.split("\t")
            status[name] = {"rc": rc, "seconds": float(seconds)}
    return parts, status


def datasheet_peak(gpu: str | None) -> float | None:
    return next((flops for key, flops in DATASHEET_BF16.items() if gpu and key in gpu), None)


def with_mfu(row: dict, shape: Shape, num_params: int, peak: float | None, sheet: float | None) -> dict:
    per_token = 6 * num_params
    per_token_attn = per_token + 12 * shape.layers * shape.seq_len * shape.hidden  # d_attn = heads x head_dim
    achieved = row["tokens_per_s"] * per_token
    out = {**row, "model_tflops_per_s": achieved / 1e12}
    if peak:
        out["mfu_vs_measured_peak"] = achieved / peak
        out["mfu_with_attention_vs_measured_peak"] = row["tokens_per_s"] * per_token_attn / peak
    if sheet:
        out["mfu_vs_datasheet_peak"] = achieved / sheet
    return out


def junit_summary(path: Path) -> dict | None:
    if not path.exists():
        return None
    import xml.etree.ElementTree as ET

    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    cases = []
    for case in suite.iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome, message = tag, (node.get("message") or "")[:400]
        cases.append({"test": case.get("name"), "outcome": outcome, "seconds": float(case.get("time", 0)),
                      "message": message})
    return {"cases": cases, **{k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}}


def report(out: Path, mode: str, shape: Shape) -> None:
    parts, status = read_parts(out)
    env, peak = parts.get("env", {}), parts.get("peak", {}).get("flops_per_s")
    sheet = datasheet_peak(env.get("gpu"))
    num_params = parts.get("model", {}).get("num_params")
    rows = {}
    for name in ("fsdp2", "plain", "megatron"):
        if name in parts and num_params:
            rows[name] = with_mfu(parts[name], shape, num_params, peak, sheet)
    ratios = {}
    if "fsdp2" in rows and "plain" in rows:
        ratios["fsdp2_over_plain_tokens_per_s"] = rows["fsdp2"]["tokens_per_s"] / rows["plain"]["tokens_per_s"]
    if "megatron" in rows and "fsdp2" in rows:
        ratios["megatron_over_fsdp2_tokens_per_s"] = rows["megatron"]["tokens_per_s"] / rows["fsdp2"]["tokens_per_s"]
    result = {"mode": mode, "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
              "command": os.environ.get("GPU_CHECK_COMMAND", ""), "shape": dataclasses.asdict(shape), "env": env,
              "status": status, "peak_bf16_flops_per_s": peak, "datasheet_bf16_flops_per_s": sheet,
              "num_params": num_params, "rows": rows, "ratios": ratios,
              "gpu_tests": junit_summary(out / "gpu_tests.xml")}
    (out / "results.json").write_text(json.dumps(result, indent=2))
    (out / "results.md").write_text(markdown(result, out))


def markdown(r: dict, out: Path) -> str:
    env, shape = r["env"], r["shape"]
    smoke = r["mode"] == "cpu-smoke"
    lines = [f"# rlmesh GPU check ({r['mode']}), {r['date_utc']} UTC", ""]
    if smoke:
        lines += ["**CPU smoke run: a tiny shape on CPU, to check the script. These are not GPU results.**", ""]
    lines += [f"Device: {env.get('gpu', 'no CUDA device')} ({env.get('num_gpus', 0)} GPU(s)); torch {env.get('torch')} "
              f"(CUDA {env.get('cuda')}, NCCL {env.get('nccl', '-')}), Python {env.get('python')}; rlmesh imported "
              f"from {env.get('rlmesh_from', '?')}.",
              "Packages: " + "; ".join(f"{k} {v}" for k, v in env.get("modules", {}).items()), "",
              f"Model: Qwen2-architecture, random init, hidden {shape['hidden']}, {shape['layers']} layers, "
              f"{shape['heads']} heads / {shape['kv_heads']} KV, MLP {shape['intermediate']}, vocab {shape['vocab']}, "
              f"tied embeddings: {r['num_params'] or '?'} parameters. Step: {shape['num_seqs']} sequences x "
              f"{shape['seq_len']} tokens; {shape['warmup']} warm-up steps, median of {shape['steps']}.", ""]
    peak = r["peak_bf16_flops_per_s"]
    lines.append(f"bf16 matmul peak ({shape['matmul_n']}^3), measured: "
                 + (f"{peak / 1e12:.4g} TFLOP/s" if peak else "not measured")
                 + (f"; datasheet {r['datasheet_bf16_flops_per_s'] / 1e12:.1f} TFLOP/s"
                    if r["datasheet_bf16_flops_per_s"] else ""))
    lines += ["", "MFU = 6 N x tokens/s / peak (N: all parameters, tied embedding once); "
              "\"+attn\" adds PaLM's 12 L s d_attn per token.", "",
              "| path | micro-batch | step s | tokens/s | model TFLOP/s | MFU (measured peak) | MFU +attn | "
              "MFU (datasheet) | peak mem GiB | loss finite |", "|---|---|---|---|---|---|---|---|---|---|"]
    names = {"fsdp2": "rlmesh learner step, FSDP2 bf16", "plain": "plain PyTorch loop, fp32 + bf16 autocast",
             "megatron": "rlmesh learner step, Megatron-core bf16"}

    def pct(v):
        return f"{100 * v:.1f}%" if v is not None else "-"

    for key, label in names.items():
        row = r["rows"].get(key)
        if row is None:
            st = r["status"].get(key, {})
            lines.append(f"| {label} | not measured (rc {st.get('rc', 'not run')}; see below) |||||||||")
            continue
        mem = row.get("peak_memory_gib")
        lines.append(f"| {label} | {row['micro_batch_size']} | {row['step_s']:.3f} | {row['tokens_per_s']:,.0f} | "
                     f"{row['model_tflops_per_s']:.1f} | {pct(row.get('mfu_vs_measured_peak'))} | "
                     f"{pct(row.get('mfu_with_attention_vs_measured_peak'))} | {pct(row.get('mfu_vs_datasheet_peak'))} | "
                     f"{f'{mem:.1f}' if mem is not None else '-'} | {row['finite']} |")
    lines.append("")
    for key, v in r["ratios"].items():
        lines.append(f"- {key}: {v:.3f}")
    if "megatron" in r["rows"]:
        lines.append(f"- Megatron layer spec: {'Transformer Engine' if r['rows']['megatron'].get('transformer_engine') else 'local (no Transformer Engine: unfused attention)'}")
    tests = r["gpu_tests"]
    lines += ["", "## gpu-marked tests (tests/e2e/test_gpu_paths.py)", ""]
    if not smoke and str(env.get("modules", {}).get("vllm", "")).startswith("not importable"):
        lines += ["vLLM is not importable here: these tests run `rlmesh up` with vLLM rollout servers, from a "
                  "`pip install -e .` of the project (their subprocess sets PYTHONPATH to the repository only, so "
                  "this script's package links do not reach it), and the two-rank one needs two GPUs. A failure "
                  "below says nothing about the learner; the rows above are the learner's GPU check.", ""]
    if tests is None:
        lines.append(f"not run or no report (rc {r['status'].get('gpu_tests', {}).get('rc', 'not run')})")
    else:
        lines.append(f"{tests['tests']} tests: {tests['failures']} failed, {tests['errors']} errors, "
                     f"{tests['skipped']} skipped")
        lines += [f"- {c['test']}: {c['outcome']} ({c['seconds']:.1f} s) {c['message']}" for c in tests["cases"]]
    lines += ["", "## Parts", "", "| part | exit status | seconds |", "|---|---|---|"]
    lines += [f"| {k} | {v['rc']} | {v['seconds']:.0f} |" for k, v in r["status"].items()]
    for key, st in r["status"].items():
        if st["rc"] != "0" and (out / "logs" / f"{key}.log").exists():
            tail = (out / "logs" / f"{key}.log").read_text(errors="replace").splitlines()[-25:]
            lines += ["", f"### {key}: exit status {st['rc']}, last lines of logs/{key}.log", "", "```", *tail, "```"]
    return "\n".join(lines) + "\n"

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(REPO / "bench/results/gpu_check"), help="the results folder of gpu_check.sh")
    p.add_argument("--cpu-smoke", dest="mode", action="store_const", const="cpu-smoke", default="gpu")
    args = p.parse_args()
    report(Path(args.out), args.mode, shape_for(args.mode))


if __name__ == "__main__":
    main()
