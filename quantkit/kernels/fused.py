"""Fused CPU ops for the decode step and the panel GEMM (csrc/), compiled once per machine and instruction set.

A single-stream CPU token with 4-bit weights is mostly per-op overhead: ~10 small PyTorch ops a layer
(norms, rotary, KV gathers and casts, softmax, SiLU) at 5-30 us each. These ops do each chain in one call
and read the paged KV cache in place. They need a C++ compiler; without one (or with QUANTKIT_FUSED=0)
`ops()` is None and the runtime keeps its PyTorch path, after saying so once.

One source, three builds: "native" (-march=native: AVX-512 BF16, AVX-512 or AVX2 kernels, whatever this CPU has),
"avx2" (any x86-64 with AVX2 + FMA) and "scalar" (portable C++: any CPU, ARM64 included). QUANTKIT_ISA=avx2 or
=scalar forces a lower one, so a machine with more still runs (and tests) the paths other CPUs take.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
from pathlib import Path

import torch

from quantkit import QuantkitError

CSRC = Path(__file__).with_name("csrc")
SOURCE = CSRC / "fused.cpp"
LEVELS = ("native", "avx2", "scalar")
# -fopenmp: at::parallel_for is inline OpenMP, so without it every op runs on one thread (the runtime is libgomp.so.1,
# already loaded by torch); -ffp-contract=off: no FMA contraction, so products round as PyTorch's do
FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux names them (empty where /proc/cpuinfo has none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((l for l in text.splitlines() if l.startswith(("flags", "Features"))), "")
    return frozenset(line.partition(":")[2].split())


def x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def native_bf16() -> bool:
    """Native bfloat16 dot products (AVX512_BF16 or AMX): where bf16 activations are faster than float32."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def amx() -> bool:
    """AMX bf16 tiles: oneDNN's bf16 GEMM runs on them, several times the panel GEMM's rate on prefill-sized inputs."""
    return "amx_bf16" in cpu_flags()


def native_isa() -> str:
    """The kernels a -march=native build compiles to here: avx512-bf16, avx512, avx2 or scalar."""
    f = cpu_flags()
    if not x86():
        return "scalar"
    if {"avx512f", "avx512dq"} <= f:
        return "avx512-bf16" if "avx512_bf16" in f else "avx512"
    return "avx2" if {"avx2", "fma"} <= f else "scalar"


def runnable_levels() -> list[str]:
    """The builds this CPU can run, best first (duplicates folded: on an AVX2-only CPU native is the AVX2 build)."""
    levels = ["native"]
    if native_isa() in ("avx512-bf16", "avx512"):
        levels.append("avx2")
    if native_isa() != "scalar":
        levels.append("scalar")
    return levels


def selected_level() -> str:
    """QUANTKIT_ISA (auto, native, avx2, scalar): the build the runtime uses."""
    name = os.environ.get("QUANTKIT_ISA", "auto").strip().lower() or "auto"
    name = "native" if name == "auto" else name
    if name not in LEVELS:
        raise QuantkitError(f"QUANTKIT_ISA={name}: use auto, {', '.join(LEVELS)}")
    if name == "avx2" and native_isa() == "avx2":
        return "native"
    if name not in runnable_levels():
        raise QuantkitError(f"QUANTKIT_ISA={name}: this CPU ({native_isa()}) cannot run it; use auto or scalar")
    return name


def level_flags(level: str) -> list[str]:
    if level == "native":
        return ["-march=native"]
    if level == "avx2":
        return ["-march=x86-64", "-mavx2", "-mfma", "-mf16c", "-mtune=generic"]
    return ["-march=x86-64", "-mtune=generic"] if x86() else []


def _build_dir(level: str) -> Path:
    """Per CPU (for the native build), torch version, flags and source: a shared home never mixes machines."""
    from quantkit.models import cache_dir

    sources = [f.read_text() for f in sorted(CSRC.iterdir()) if f.suffix in (".cpp", ".h")]
    cpu = " ".join(sorted(cpu_flags())) if level == "native" else platform.machine()
    key = hashlib.sha256("\n".join([cpu, torch.__version__, *sources, *FLAGS, *level_flags(level)]).encode()).hexdigest()[:16]
    root = cache_dir() / "kernels" / f"{level}-{key}"
    root.mkdir(parents=True, exist_ok=True)
    return root


def ops():
    """The compiled module for the selected instruction set, or None when it cannot be built here (reported once).
    Waits for a build `prepare` started."""
    if os.environ.get("QUANTKIT_FUSED", "1") == "0":
        return None
    return build(selected_level())


def expected() -> bool:
    """Whether `ops()` should come (enabled, a compiler present), without waiting for a build in progress."""
    if os.environ.get("QUANTKIT_FUSED", "1") == "0":
        return False
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return ops() is not None  # None at once, and the missing compiler said once
    return True


def prepare() -> None:
    """Start the selected build in a background thread (loading it, when cached), so the compiler runs while
    the weights and the tokenizer load: the engine calls this first and waits only when it needs the ops."""
    if expected() and selected_level() not in _BUILT:
        threading.Thread(target=ops, name="quantkit-kernels", daemon=True).start()


def panel_dtypes() -> tuple[str, ...]:
    """Activation dtypes the panel GEMM takes: the built module's answer, or while it is still compiling the
    prediction from its flags (bf16 panels only in a -march=native build on a CPU with AVX512_BF16)."""
    level = selected_level()
    if _BUILT.get(level) is not None:
        return tuple(_BUILT[level].panel_dtypes())
    return ("float32", "bfloat16") if level == "native" and "avx512_bf16" in cpu_flags() else ("float32",)


def loaded():
    """The module if it is built or only needs loading (cached), else None, without waiting for a compile: for
    work at load time that has a slower PyTorch equivalent (panel packing)."""
    level = selected_level()
    if level not in _BUILT and level not in _CACHED:
        if not (expected() and any(_build_dir(level).glob("*.so"))):
            return None
        _CACHED.add(level)  # (the build directory's key hashes the sources: once per process is enough)
    return ops()


_BUILT: dict[str, object] = {}
_CACHED: set[str] = set()
_LOCK = threading.Lock()


def build(level: str):
    """The module compiled for `level` (one of LEVELS), or None (reported once on stderr); compiled at most
    once per process even when several threads ask at the same time."""
    if level in _BUILT:  # the hot path: every fused op call comes through here
        return _BUILT[level]
    with _LOCK:
        if level not in _BUILT:
            _BUILT[level] = _compile(level)
        return _BUILT[level]


def _compile(level: str):
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return _unavailable(f"no C++ compiler: {compiler} not found")
    try:
        root = _build_dir(level)
        if (built := _import_built(root / f"quantkit_fused_{level}.so")) is not None:
            return built
        from torch.utils.cpp_extension import load

        venv_bin = str(Path(sys.executable).parent)  # where pip puts `ninja`, which the build runs
        if venv_bin not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")
        if not any(root.glob("*.so")):
            isa = native_isa() if level == "native" else level
            print(f"quantkit: compiling the CPU kernels for {isa} while the model loads (once per machine, ~40 s)",
                  file=sys.stderr, flush=True)
        logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # its compiler-ABI lecture
        return load(f"quantkit_fused_{level}", [str(SOURCE)], extra_cflags=FLAGS + level_flags(level), extra_ldflags=["-fopenmp"],
                    build_directory=str(root), verbose=False)
    except Exception as e:  # noqa: BLE001 -- no ninja, a failed build: the PyTorch path still works
        lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
        return _unavailable(next((line for line in lines if "error" in line.lower() and "building extension" not in line.lower()),
                                 lines[-1])[:300])


def _import_built(so: Path):
    """The module a build left in its directory (keyed by the sources, flags, torch and CPU), imported directly:
    0.6 ms, where torch's `load` takes 0.13 s to import itself and ask ninja whether the build is current, most
    of it holding the GIL that a starting server's main thread needs. None when there is none, or it does not
    import (an interrupted link): then `load` makes it again."""
    import importlib.util

    if not so.is_file():
        return None
    try:
        spec = importlib.util.spec_from_file_location(so.stem, so)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except ImportError:
        return None


def describe() -> str:
    """Which kernels run and why, for the engine's start line."""
    m = ops()
    if m is None:
        return "PyTorch ops (no fused CPU kernels)"
    why = "forced by QUANTKIT_ISA" if os.environ.get("QUANTKIT_ISA", "auto") not in ("", "auto", "native") else "this CPU's best"
    return f"{m.isa()} CPU kernels ({why})"


def _unavailable(reason: str) -> None:
    print(f"quantkit: fused CPU kernels unavailable ({reason}); decoding with PyTorch ops instead", file=sys.stderr)
