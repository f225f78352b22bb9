"""How far vLLM with the connector is from vLLM without one: the first greedy token that differs.

Three fresh engines (SmolLM2-135M, bf16, eager, chunks of 512 tokens), the same prompts:
`none` (no connector), `stores` (ours against an empty service: it computes everything and
stores) and `loads` (ours, after `stores`: it loads every whole block it can). Prints, per
prompt, the tokens each had cached (vLLM's own hits and ours) and the first of `--tokens`
greedy tokens where `stores` and `loads` differ from `none` ("same" when none does).

    python -m bench.vllm_exactness [--tokens 64]
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
from pathlib import Path

from bench.services import our_service
from bench.vllm_engine import EngineProcess
from bench.vllm_ttft import MODEL_CACHE, VLLM_PYTHON


def _prompts(model: Path) -> list[list[int]]:
    """Three random prompts sharing 900 tokens, and an English one read by the tokenizer."""
    from transformers import AutoTokenizer  # noqa: PLC0415 (the [model] extra)

    draw = random.Random(24)
    system = [draw.randrange(100, 49000) for _ in range(900)]
    prompts = [system + [draw.randrange(100, 49000) for _ in range(n)] for n in (150, 230, 310)]
    text = (
        "You are a helpful assistant. Answer the user's questions about the company's "
        "services concisely and accurately. "
        * 40
        + "Question: what is the capital of France? Answer:"
    )
    prompts.append(AutoTokenizer.from_pretrained(model)(text)["input_ids"])
    return prompts


def main() -> None:
    """Run the three engines one after the other and print where they part."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    from cache_service.integrations.hf_export import export_smollm2  # noqa: PLC0415

    model = export_smollm2(MODEL_CACHE / "smollm2-135m-instruct-hf")
    prompts = _prompts(model)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHE_SERVICE_")}
    work = Path(tempfile.mkdtemp(prefix="vllm-exactness-"))
    outputs: dict[str, list[dict[str, object]]] = {}
    with our_service(work / "data") as service:
        runs = {
            "none": ["--connector", "none"],
            "stores": ["--url", service.url],
            "loads": ["--url", service.url],
        }
        for name, flags in runs.items():
            engine = EngineProcess(
                VLLM_PYTHON, model, work / f"{name}.log", *flags,
                "--max-num-batched-tokens", "512", env=env,
            )  # fmt: skip
            try:
                outputs[name] = engine.generate(prompts, max_tokens=args.tokens)
                engine.ask("wait_stores", seconds=60)
            finally:
                engine.close()
    for index, prompt in enumerate(prompts):
        reference = outputs["none"][index]["tokens"]
        cells = []
        for name in ("stores", "loads"):
            output = outputs[name][index]
            tokens = output["tokens"]
            assert isinstance(tokens, list) and isinstance(reference, list)
            first = next(
                (i for i, (a, b) in enumerate(zip(reference, tokens, strict=False)) if a != b), None
            )
            where = "same" if first is None else f"differs from token {first}"
            cells.append(f"{name}: {output['cached_tokens']} tokens cached, {where}")
        print(f"prompt {index} ({len(prompt):,} tokens): " + "; ".join(cells))


if __name__ == "__main__":
    main()
