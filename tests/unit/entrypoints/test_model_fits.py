"""What is refused before anything starts, saying why and what to do: a model that is missing or
does not fit (an architecture the weight broadcast is not proven to keep in sync, a chat prompt
format for a tokenizer without a template), a queue URL a tier started on its own cannot dial, and a
run or output directory that cannot be made; nothing is left behind."""

import json
import re

import pytest

from rlmesh.learner.devtools.tiny_model import write_tiny_model
from rlmesh.services.config import TinyModelSection, load_config
from rlmesh.preflight import check_model_fits


def _config(path, *overrides):
    return load_config(None, ["model.type=hf", f"model.path={path}", *overrides])


def test_an_unproven_architecture_is_refused_naming_it_and_the_supported_families(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPTNeoXForCausalLM"]}))
    with pytest.raises(SystemExit, match=r"rlmesh up: model architecture GPTNeoXForCausalLM cannot be served with "
                                         r"in-place weight updates.*supported families: .*Gemma 3.*"
                                         r"model.allow_untested_architecture=true"):
        check_model_fits(_config(tmp_path), str(tmp_path), "up")


def test_chat_for_a_model_without_a_template_is_refused_and_auto_takes_plain_text(tmp_path, capsys):
    model = write_tiny_model(TinyModelSection(arch="llama"), tmp_path / "m", seed=0)
    (model / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit, match="rlmesh eval: prompt.format=chat, but the tokenizer .* has no chat template"):
        check_model_fits(_config(model, "prompt.format=chat"), str(model), "eval")
    check_model_fits(_config(model), str(model), "eval")
    assert "has no chat template: prompts are plain text" in capsys.readouterr().out


def test_a_model_not_fetched_yet_is_refused_at_once_with_the_fetch_command(tmp_path, monkeypatch):
    """The examples' model.path on a fresh checkout: no hub look-up (a minute of retries offline), the
    command that writes it; a plain local path that is no directory is refused too."""
    import time

    monkeypatch.chdir(tmp_path)
    t0 = time.monotonic()
    with pytest.raises(SystemExit, match=r"rlmesh up: model.path=models/gemma3-270m does not exist yet; fetch it "
                                         r"first: rlmesh model fetch gemma3-270m --output models/gemma3-270m$"):
        check_model_fits(_config("models/gemma3-270m"), "models/gemma3-270m", "up")
    assert time.monotonic() - t0 < 5
    with pytest.raises(SystemExit, match=r"rlmesh eval: model.path=./my-model is not a directory here.*"
                                         r"smollm2-135m-instruct, gemma3-270m.*convert-gguf"):
        check_model_fits(_config("./my-model"), "./my-model", "eval")


def test_rlmesh_up_refuses_a_missing_model_before_making_a_run_directory(tmp_path):
    """A typo in model.path leaves nothing behind: no run directory, no config, no service started."""
    import argparse

    from rlmesh.up import run_up

    config = load_config(None, ["model.type=hf", f"model.path={tmp_path}/no-such-model",
                                f"run.output_dir={tmp_path}/runs"])
    with pytest.raises(SystemExit, match=r"rlmesh up: model.path=.*no-such-model.* does not exist"):
        run_up(config, argparse.Namespace(run_dir=None))
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("command", ["sft", "dpo"])
def test_rlmesh_sft_and_dpo_refuse_a_missing_model_by_name_not_with_a_traceback(tmp_path, command):
    from rlmesh.cli import main

    with pytest.raises(SystemExit, match=rf"rlmesh {command}: model.path=.*no-such-model is not a directory here"):
        main([command, "--output", str(tmp_path / "out"), f"{command}.num_steps=1", "learner.max_tokens_per_micro_batch=0",
              "model.type=hf", f"model.path={tmp_path}/no-such-model"])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("tier", ["rollout", "learner"])
@pytest.mark.parametrize("url, says", [("embedded", "only `rlmesh up` starts an embedded queue server"),
                                       ("http://:s3cret@queue:6379", r"queue.url='http://:\*\*\*@queue:6379' is not a "
                                                                      r"redis://")])
def test_a_tier_on_its_own_refuses_a_queue_url_it_cannot_dial_before_loading_anything(tmp_path, capsys, tier, url, says):
    """`rlmesh rollout -c examples/...` (queue.url: embedded) used to load vLLM for 20 s, then raise."""
    import time

    from rlmesh.cli import main

    t0 = time.monotonic()
    assert main([tier, "--run-dir", str(tmp_path / "run"), "network.insecure=true", f"queue.url={url}"]
                if tier == "learner" else [tier, "network.insecure=true", f"queue.url={url}"]) == 2
    err = capsys.readouterr().err
    assert re.search(rf"rlmesh {tier}: .*{says}", err) and "s3cret" not in err
    assert time.monotonic() - t0 < 10 and not (tmp_path / "run").exists()


@pytest.mark.parametrize("argv, says", [
    (["eval", "--model", "/no/such/model"], r"rlmesh eval: --model '/no/such/model' is neither an HF model directory"),
    (["check", "model.type=hf", "model.path=/no/such/model"], r"rlmesh check: model.path=/no/such/model is not a "
                                                              r"directory here")])
def test_rlmesh_eval_and_check_of_a_missing_model_leave_no_output_directory(tmp_path, monkeypatch, argv, says):
    from rlmesh.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match=says):
        main([*argv, "run.output_dir=runs"])
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


@pytest.mark.parametrize("where", ["--run-dir", "run.output_dir"])
def test_rlmesh_up_where_no_run_directory_can_be_made_says_which_option_to_change(tmp_path, where):
    import argparse

    from rlmesh.up import run_up

    (tmp_path / "a-file").write_text("")
    blocked = str(tmp_path / "a-file" / "runs")
    config = load_config(None, [] if where == "--run-dir" else [f"run.output_dir={blocked}"])
    with pytest.raises(SystemExit, match=rf"rlmesh up: cannot make the run directory \(Not a directory: .*a-file.*\); "
                                         rf"give {where} a place this user can write"):
        run_up(config, argparse.Namespace(run_dir=blocked if where == "--run-dir" else None))


@pytest.mark.parametrize("command", ["sft", "dpo", "eval", "check", "tiny-model", "model", "export", "tls-init"])
def test_an_output_directory_that_cannot_be_written_is_refused_before_any_work(tmp_path, capsys, command):
    from rlmesh.cli import main

    (tmp_path / "a-file").write_text("")
    before = {"model": ["fetch", "smollm2-135m-instruct"], "export": [str(tmp_path)]}.get(command, [])
    extra = {"sft": ["sft.num_steps=1"], "dpo": ["dpo.num_steps=1"], "eval": ["--model", str(tmp_path)]}.get(command, [])
    assert main([command, *before, "--output", str(tmp_path / "a-file" / "out"), *extra]) == 2
    assert re.search(rf"rlmesh {command}: --output .*a-file/out: .*a-file is a file, not a directory; give a "
                     "directory this user can write", capsys.readouterr().err)


def test_a_context_longer_than_the_model_s_is_refused_before_vllm_loads(tmp_path):
    """vLLM refuses it in every rollout server after the mesh is up, and again on every restart."""
    model = write_tiny_model(TinyModelSection(arch="llama"), tmp_path / "m", seed=0)
    limit = json.loads((model / "config.json").read_text())["max_position_embeddings"]
    with pytest.raises(SystemExit, match=rf"rlmesh up: rollout.max_model_len={limit + 1} is longer than .*'s context "
                                         rf"\(max_position_embeddings={limit} in its config.json\); set "
                                         rf"rollout.max_model_len={limit} or less"):
        check_model_fits(_config(model, f"rollout.max_model_len={limit + 1}"), str(model), "up")
    check_model_fits(_config(model, f"rollout.max_model_len={limit}"), str(model), "up")
    hf = json.loads((model / "config.json").read_text())
    hf["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}  # stretched: vLLM's own check decides
    (model / "config.json").write_text(json.dumps(hf))
    check_model_fits(_config(model, f"rollout.max_model_len={limit + 1}"), str(model), "up")
