"""Fused CPU ops for the decode step (csrc/fused.cpp), compiled once per machine on first use.

A single-stream CPU token with 4-bit weights is mostly per-op overhead: ~10 small PyTorch ops a layer
(norms, rotary, KV gathers and casts, softmax, SiLU) at 5-30 us each. These ops do each chain in one call
and read the paged KV cache in place. They need a C++ compiler; without one (or with QUANTKIT_FUSED=0)
`ops()` is None and the runtime keeps its PyTorch path, after saying so once.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import sys
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("csrc") / "fused.cpp"
# -fopenmp: at::parallel_for is inline OpenMP, so without it every op runs on one thread (the runtime is libgomp.so.1,
# already loaded by torch); -ffp-contract=off: no FMA contraction, so products round as PyTorch's do
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]


def _build_dir() -> Path:
    """Per CPU (the build is -march=native), torch version and source: a shared home never mixes machines."""
    flags = ""
    if Path("/proc/cpuinfo").exists():
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    from quantkit.models import cache_dir

    sources = [f.read_text() for f in sorted(SOURCE.parent.iterdir()) if f.suffix in (".cpp", ".h")]
    key = hashlib.sha256("\n".join([flags, torch.__version__, *sources, *FLAGS]).encode()).hexdigest()[:16]
    root = cache_dir() / "kernels" / key
    root.mkdir(parents=True, exist_ok=True)
    return root


@functools.cache
def ops():
    """The compiled module, or None when it cannot be built here (reported once on stderr)."""
    if os.environ.get("QUANTKIT_FUSED", "1") == "0":
        return None
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return _unavailable(f"no C++ compiler: {compiler} not found")
    try:
        from torch.utils.cpp_extension import load

        build = _build_dir()
        venv_bin = str(Path(sys.executable).parent)  # where pip puts `ninja`, which the build runs
        if venv_bin not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")
        if not any(build.glob("*.so")):
            print("quantkit: compiling fused CPU kernels (once per machine, ~30 s)", file=sys.stderr, flush=True)
        logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # its compiler-ABI lecture
        return load("quantkit_fused", [str(SOURCE)], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"], build_directory=str(build),
                    verbose=False)
    except Exception as e:  # noqa: BLE001 -- no ninja, a failed build: the PyTorch path still works
        lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
        return _unavailable(next((line for line in lines if "error" in line.lower() and "building extension" not in line.lower()),
                                 lines[-1])[:300])


def _unavailable(reason: str) -> None:
    print(f"quantkit: fused CPU kernels unavailable ({reason}); decoding with PyTorch ops instead", file=sys.stderr)
