"""The safetensors container: an 8-byte little-endian header length, a JSON header, then the tensors' bytes.

One place writes the header, for the checkpoint writer (formats/save.py) and for the runtime's panel cache, which
also needs its tensors 64-byte aligned: kernels load whole cache lines from them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

ST_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


def header_bytes(header: dict, align: int = 8) -> bytes:
    """Length prefix and JSON header, padded with spaces so tensor data starts `align`-byte aligned in the file."""
    h = json.dumps({"__metadata__": {"format": "pt"}, **header}, separators=(",", ":")).encode()
    h += b" " * (-(len(h) + 8) % align)
    return len(h).to_bytes(8, "little") + h


def write(path: Path, tensors: dict[str, Tensor], align: int = 8) -> None:
    """Whole tensors to one file, each starting `align`-byte aligned (sizes must be multiples of `align`)."""
    header, offset = {}, 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if nbytes % align:
            raise ValueError(f"tensor {name}: {nbytes} bytes is not a multiple of {align}")
        header[name] = {"dtype": ST_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    with open(path, "wb") as f:
        f.write(header_bytes(header, align))
        for t in tensors.values():
            f.write(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())  # the tensor's own bytes: no copy
