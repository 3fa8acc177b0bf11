"""GGUF file -> dense Hugging Face checkpoint, one tensor at a time.

transformers' own GGUF loader dequantizes the whole file into memory before building the model (5.6 GB
of peak RSS for a 1.5B model). Here each tensor is read from the file with a plain read (not through the
memory map, whose touched pages would count as resident), dequantized by the same `gguf` routines and
tensor processors transformers uses, cast to the checkpoint dtype and streamed into safetensors shards;
the largest tensors (embeddings, output layer) go in row blocks. The result is bit-identical to what
`AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` holds (tested), at about one tensor of memory.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize

from quantkit import QuantkitError
from quantkit.arch import gguf_names

ROW_BLOCK_BYTES = 32 << 20  # dequantize big tensors this many float32 bytes at a time
MAX_SHARD_BYTES = 2 << 30
_PLAIN = {GGMLQuantizationType.F32: np.dtype(np.float32), GGMLQuantizationType.F16: np.dtype(np.float16)}  # stored as values


@dataclass(slots=True)
class GGUFTensor:
    name: str  # the HF name it becomes
    gguf_name: str
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int
    raw_shape: tuple[int, ...]  # numpy shape of the stored data (rows x bytes for block types)
    raw_dtype: np.dtype
    shape: tuple[int, ...]  # dequantized shape, numpy (row-major) order


def read_tensor_table(path: Path) -> tuple[str, list[tuple[str, tuple[int, ...], int, int, int]]]:
    """(architecture, [(gguf name, numpy shape, ggml type, absolute offset, bytes)]) from the file's header,
    skipping over the metadata values (a vocabulary is 150k strings) instead of parsing them."""
    try:
        with open(path, "rb") as f:
            r = _Header(f)
            if r.take(4) != b"GGUF":
                raise ValueError("no GGUF magic bytes")
            version, n_tensors, n_kv = r.unpack("<IQQ")
            if version not in (2, 3):
                raise ValueError(f"GGUF version {version}")
            arch, alignment = None, 32
            for _ in range(n_kv):
                key = r.string()
                (vtype,) = r.unpack("<I")
                value = r.value(vtype)
                arch = value if key == "general.architecture" else arch
                alignment = int(value) if key == "general.alignment" else alignment
            entries = []
            for _ in range(n_tensors):
                name = r.string()
                (ndim,) = r.unpack("<I")
                dims = r.unpack(f"<{ndim}Q")
                qtype, offset = r.unpack("<IQ")
                entries.append((name, tuple(int(d) for d in reversed(dims)), qtype, offset))
            data_start = -(-r.pos // alignment) * alignment
    except (ValueError, OSError, struct.error, UnicodeDecodeError) as e:
        raise QuantkitError(f"cannot read GGUF {path}: {type(e).__name__}: {e}") from None
    if arch is None:
        raise QuantkitError(f"cannot read GGUF {path}: no general.architecture in its metadata")
    table = []
    for name, shape, qtype, offset in entries:
        try:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        except (ValueError, KeyError):
            raise QuantkitError(f"GGUF {path.name}: tensor {name} has ggml type {qtype}, which cannot be dequantized here") from None
        table.append((name, shape, qtype, data_start + offset, math.prod(shape) // block * size))
    end = max((offset + nbytes for *_, offset, nbytes in table), default=0)
    if end > path.stat().st_size:
        raise QuantkitError(f"GGUF {path.name} is truncated: its tensors need {end:,} bytes, the file has {path.stat().st_size:,}")
    return arch, table


class _Header:
    """Sequential reads over a GGUF header."""

    def __init__(self, f):
        self.f, self.pos = f, 0

    def take(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise ValueError("file ends inside its header")
        self.pos += n
        return data

    def unpack(self, fmt: str) -> tuple:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))

    def string(self) -> str:
        (n,) = self.unpack("<Q")
        return self.take(n).decode()

    def value(self, vtype: int):
        """A scalar or string value; arrays are skipped over (None)."""
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])[0]
        if vtype == 8:
            return self.string()
        if vtype != 9:
            raise ValueError(f"metadata value of type {vtype}")
        etype, count = self.unpack("<IQ")
        if etype in _SCALARS:
            self.f.seek(struct.calcsize(_SCALARS[etype]) * count, os.SEEK_CUR)
            self.pos += struct.calcsize(_SCALARS[etype]) * count
            return None
        for _ in range(count):
            self.value(etype)
        return None


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def check_architecture(path: Path) -> str:
    arch, _ = read_tensor_table(path)
    if arch not in gguf_names():  # (a llama GGUF named "mistral" loads as Mistral)
        raise QuantkitError(
            f"unsupported architecture {arch!r} in GGUF {path.name}: quantkit converts {', '.join(gguf_names())} GGUFs"
        )
    return arch


def convert(path: Path, out: Path, name: str, dtype: torch.dtype = torch.bfloat16, say: Callable[[str], None] = lambda m: None,
            on_tensor: Callable[[int, int], None] | None = None) -> None:
    """Write the dense checkpoint of GGUF `path` into the (empty, existing) directory `out`."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from quantkit.formats.save import ShardWriter
    from quantkit.models import quiet_transformers

    check_architecture(path)
    with quiet_transformers():
        try:
            config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        except Exception as e:  # gguf and transformers raise many kinds on a bad file
            raise QuantkitError(f"cannot read GGUF {path}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
        tensors, processor, architecture = plan(path, config)
        check_dequantizable(path, tensors)
        writer = ShardWriter(out, MAX_SHARD_BYTES)
        with open(path, "rb") as f:
            for i, t in enumerate(tensors):
                writer.add_blocks(t.name, dtype, t.shape, dequantized_blocks(f, t, processor, dtype))
                if on_tensor:
                    on_tensor(i + 1, len(tensors))
        writer.finish()
        config.name_or_path = name
        config.dtype = dtype
        config.architectures = [architecture]
        config.save_pretrained(out)
        GenerationConfig.from_model_config(config).save_pretrained(out)
        tokenizer.save_pretrained(out)


def plan(path: Path, config) -> tuple[list[GGUFTensor], object, str]:
    """Every GGUF tensor the model has a place for, with the HF name transformers' loader gives it; the
    tensor processor; the model class."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    arch, table = read_tensor_table(path)
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    names = get_gguf_hf_weights_map(skeleton, processor)
    tensors = []
    for gguf_name, shape, qtype, offset, nbytes in table:
        if gguf_name not in names:
            continue
        qtype = GGMLQuantizationType(qtype)
        raw_dtype = _PLAIN.get(qtype, np.dtype(np.uint8))
        rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
        raw_shape = shape if qtype in _PLAIN else (rows, nbytes // rows)
        tensors.append(GGUFTensor(names[gguf_name], gguf_name, qtype, offset, nbytes, raw_shape, raw_dtype, shape))
    return tensors, processor, type(skeleton).__name__


def check_dequantizable(path: Path, tensors: list[GGUFTensor]) -> None:
    """Fail before writing anything when a tensor's quant type has no dequantizer."""
    seen = set()
    with open(path, "rb") as f:
        for t in tensors:
            if t.qtype in seen:
                continue
            seen.add(t.qtype)
            try:
                dequantize(_read_rows(f, t, 0, 1), t.qtype)
            except (NotImplementedError, ValueError) as e:
                raise QuantkitError(
                    f"GGUF {path.name}: tensor {t.gguf_name} is {t.qtype.name}, which cannot be dequantized here ({e})"
                ) from None


def dequantized_blocks(f, t: GGUFTensor, processor, dtype: torch.dtype) -> Iterator[torch.Tensor]:
    """The tensor in `dtype`: 2-D tensors whose processing is row-local in blocks of ROW_BLOCK_BYTES of
    float32 (the 150k-row embedding never exists whole in float32), anything else whole."""
    rows = t.raw_shape[0] if len(t.raw_shape) == 2 else 1
    step = max(1, ROW_BLOCK_BYTES // (4 * t.shape[-1])) if len(t.raw_shape) == 2 and _row_safe(t.gguf_name) else rows
    for start in range(0, rows, step):
        weights = dequantize(_read_rows(f, t, start, min(rows, start + step)), t.qtype)
        weights = processor.process(weights=weights, name=t.gguf_name).weights
        yield torch.from_numpy(np.ascontiguousarray(weights)).to(dtype)


def _row_safe(gguf_name: str) -> bool:
    """Tensors whose processing is row-local: only the q/k projections are permuted across rows (llama)."""
    return ".attn_q." not in gguf_name and ".attn_k." not in gguf_name


def _read_rows(f, t: GGUFTensor, start: int, stop: int) -> np.ndarray:
    if len(t.raw_shape) != 2:
        return _read_all(f, t)
    row_bytes = t.nbytes // t.raw_shape[0]
    buf = os.pread(f.fileno(), (stop - start) * row_bytes, t.offset + start * row_bytes)
    if len(buf) != (stop - start) * row_bytes:
        raise QuantkitError(f"GGUF {Path(f.name).name} is truncated: tensor {t.gguf_name} runs past the end of the file")
    return np.frombuffer(buf, dtype=t.raw_dtype).reshape(stop - start, t.raw_shape[1]).copy()


def _read_all(f, t: GGUFTensor) -> np.ndarray:
    buf = os.pread(f.fileno(), t.nbytes, t.offset)
    if len(buf) != t.nbytes:
        raise QuantkitError(f"GGUF {Path(f.name).name} is truncated: tensor {t.gguf_name} runs past the end of the file")
    return np.frombuffer(buf, dtype=t.raw_dtype).reshape(t.raw_shape).copy()

