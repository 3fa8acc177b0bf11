"""The bitsandbytes baseline: NF4 or INT8 through HF transformers, written as an HF bitsandbytes checkpoint.

Calibration-free and not compressed-tensors: it is here so quantkit's own methods can be measured
against what many users reach for first. Loading quantizes the whole model in memory (no layer walk).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from quantkit import QuantkitError
from quantkit.formats.save import MANIFEST_NAME, atomic_dir
from quantkit.memory import peak_rss_bytes


def bnb_config(method: str, dtype: torch.dtype):
    try:
        import bitsandbytes  # noqa: F401
    except Exception as e:  # not installed, or its native library failed to load
        raise QuantkitError(
            f"--method {method} needs bitsandbytes, which cannot be imported here ({type(e).__name__}: {e}); "
            "install it with: pip install 'quantkit[bnb]'"
        ) from e
    from transformers import BitsAndBytesConfig

    if method == "bnb-nf4":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype,
                                  llm_int8_skip_modules=["lm_head"])
    return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=["lm_head"])


def run_bnb(resolved, out: Path, recipe, force: bool, ui):
    from transformers import AutoModelForCausalLM

    from quantkit.models import DTYPES, load_tokenizer, quiet_transformers
    from quantkit.quantize import QuantizeResult

    dtype = DTYPES[recipe.dtype]
    start = time.perf_counter()
    config = bnb_config(recipe.method, dtype)
    with ui.step(f"quantizing with bitsandbytes ({recipe.method})"), quiet_transformers():
        try:
            model = AutoModelForCausalLM.from_pretrained(resolved.path, quantization_config=config, device_map="cpu", dtype=dtype)
        except Exception as e:
            raise QuantkitError(f"bitsandbytes cannot run {recipe.method} on this machine's CPU: {type(e).__name__}: {e}") from e
    quantize_s = round(time.perf_counter() - start, 3)
    start = time.perf_counter()
    with atomic_dir(out, force) as tmp, quiet_transformers():
        model.save_pretrained(tmp)
        tokenizer = load_tokenizer(resolved.path)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        timings = {"quantize": quantize_s, "save": round(time.perf_counter() - start, 3)}
        manifest = {"recipe": recipe.to_dict(), "source": {"model": resolved.spec, "kind": resolved.kind}, "timings_s": timings}
        (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
    files = sorted(p.name for p in out.glob("*.safetensors"))
    from quantkit.formats.load import SafetensorsSource

    params = SafetensorsSource(resolved.path).parameters(bool(model.config.tie_word_embeddings))
    quantized = sum(type(m).__name__ in ("Linear4bit", "Linear8bitLt") for m in model.modules())
    return QuantizeResult(out=out, recipe=recipe, quantized_modules=quantized, dense_bytes=params * 2,
                          out_bytes=sum((out / f).stat().st_size for f in files), files=files, timings_s=timings,
                          peak_rss_bytes=peak_rss_bytes())
