"""What the launchers (`rlmesh up`, `eval`, `check`) check before starting anything, and how text
from other tiers is put on the console."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlmesh.services.config import RunConfig


def check_model_fits(config: RunConfig, model_dir: str, command: str) -> None:
    """Refuse, before starting anything, a model whose architecture the weight broadcast is not proven
    to keep in sync (services/model_families.py), and a prompt format its tokenizer cannot render
    (e.g. prompt.format=chat for a base model without a chat template); say which format is used."""
    from transformers import AutoTokenizer

    from rlmesh.services.config import HFModelSection
    from rlmesh.services.domain.chat import make_codec
    from rlmesh.services.model_families import UnsupportedArchitecture, check_supported_architecture

    check_model_present(model_dir, command)
    check_context_fits(config, model_dir, command)
    allow = isinstance(config.model, HFModelSection) and config.model.allow_untested_architecture
    if (Path(model_dir) / "config.json").is_file() and not allow:
        try:
            check_supported_architecture(model_dir)
        except UnsupportedArchitecture as err:
            raise SystemExit(f"rlmesh {command}: {err} (model.allow_untested_architecture=true starts anyway)") \
                from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as err:
        raise SystemExit(f"rlmesh {command}: cannot load the tokenizer of {model_dir} ({err}); model.path must be "
                         "an HF model directory with its tokenizer files") from None
    try:
        codec = make_codec(tokenizer, config.prompt)
    except ValueError as err:
        raise SystemExit(f"rlmesh {command}: {err}") from None
    if codec.format != "chat":
        why = "has no chat template" if config.prompt.format == "auto" else "is prompted as configured"
        print(f"rlmesh {command}: {model_dir} {why}: prompts are plain text (prompt.format="
              f"{config.prompt.format}; prefix {len(config.prompt.prefix)} chars, suffix {config.prompt.suffix!r}, "
              f"stop {config.prompt.stop})", flush=True)


def check_context_fits(config: RunConfig, model_dir: str, command: str) -> None:
    """Refuse a rollout.max_model_len beyond the context the model's config.json gives
    (max_position_embeddings, where no RoPE scaling stretches it): vLLM refuses it at load, in
    every rollout server, after the mesh has started (and each restart of them fails the same way)."""
    import json

    path = Path(model_dir).expanduser() / "config.json"
    if not path.is_file():
        return
    hf = json.loads(path.read_text())
    hf = hf.get("text_config") or hf  # a multimodal model's language part
    limit = hf.get("max_position_embeddings")
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    stretched = isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) not in (None, "default")
    if isinstance(limit, (int, float)) and not stretched and config.rollout.max_model_len > limit:
        raise SystemExit(f"rlmesh {command}: rollout.max_model_len={config.rollout.max_model_len} is longer than "
                         f"{model_dir}'s context (max_position_embeddings={int(limit)} in its config.json); set "
                         f"rollout.max_model_len={int(limit)} or less")


def check_model_present(model_dir: str, command: str) -> None:
    """Refuse at once a model.path that is no directory here but names a model `rlmesh model fetch`
    ships (the examples' `models/...`: a fresh checkout has none until fetched), or that is plainly a
    local path; anything else may be a hub name, which transformers then tries."""
    from rlmesh.models import REGISTRY

    path = Path(model_dir).expanduser()
    if path.is_dir():
        return
    if path.name in REGISTRY:
        raise SystemExit(f"rlmesh {command}: model.path={model_dir} does not exist yet; fetch it first: "
                         f"rlmesh model fetch {path.name} --output {model_dir}")
    if model_dir.startswith((".", "/", "~")) or model_dir.count("/") > 1:
        raise SystemExit(f"rlmesh {command}: model.path={model_dir} is not a directory here; point it at an HF "
                         f"model directory (rlmesh model fetch NAME --output DIR writes one of "
                         f"{', '.join(REGISTRY)}; rlmesh model convert-gguf FILE --output DIR converts a GGUF file)")


def printable(text: str) -> str:
    """`text` (from another tier: a reason a rollout server gave) without control characters that
    would move the cursor or recolour the console."""
    return "".join(c if c.isprintable() or c == "\n" else "?" for c in text)
