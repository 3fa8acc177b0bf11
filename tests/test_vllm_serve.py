"""`quantkit serve --engine vllm`: the vLLM command built from quantkit's flags, the wait for its health, signals
forwarded and its exit status returned. vLLM itself is not installed here (its own environment: test_vllm_interop.py
runs against it where it is), so a stand-in process answers /health and records what it was started with."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import run_cli
from test_cli import assert_one_line_error

from quantkit.server.vllm import VllmLaunch, find_vllm, vllm_args

FAKE_VLLM = """
    import json, signal, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    args = sys.argv[1:]
    open(RECORD, "w").write(json.dumps(args))
    port = int(args[args.index("--port") + 1])
    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404); self.end_headers()
        def log_message(self, *a): pass
    server = HTTPServer(("127.0.0.1", port), Health)
    def stop(signum, frame):
        open(RECORD + ".signal", "w").write(str(signum)); sys.exit(3)
    signal.signal(signal.SIGTERM, stop)
    server.serve_forever()
"""


def _fake_vllm(tmp_path: Path) -> tuple[Path, Path]:
    """A `python` in a bin folder that, run as `python -m MODULE ARGS`, serves /health and records ARGS."""
    record = tmp_path / "args.json"
    body = textwrap.dedent(FAKE_VLLM).replace("RECORD", repr(str(record)))
    python = tmp_path / "bin" / "python"
    python.parent.mkdir()
    python.write_text(f"#!{sys.executable}\nimport sys\nsys.argv = sys.argv[:1] + sys.argv[3:]\n{body}")
    python.chmod(0o755)
    return python, record


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_command_carries_quantkits_flags(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"quantization_config": {"kv_cache_scheme": {"num_bits": 8}}}))
    args = vllm_args(VllmLaunch(ckpt, "0.0.0.0", 9001, "m", "k", 4096, 8, "auto", 2 << 30, 2, 3, draft="/d",
                                num_speculative_tokens=5, extra=["--enforce-eager"]))
    pairs = dict(zip(args[::2], args[1::2]))
    assert pairs["--model"] == str(ckpt) and pairs["--kv-cache-dtype"] == "fp8"  # the checkpoint's calibrated scales
    assert (pairs["--tensor-parallel-size"], pairs["--pipeline-parallel-size"], pairs["--port"]) == ("2", "3", "9001")
    assert (pairs["--api-key"], pairs["--max-model-len"], pairs["--kv-cache-memory-bytes"]) == ("k", "4096", str(2 << 30))
    assert json.loads(pairs["--speculative-config"]) == {"method": "draft_model", "model": "/d", "num_speculative_tokens": 5}
    assert args[-1] == "--enforce-eager"
    (ckpt / "config.json").write_text("{}")
    args = vllm_args(VllmLaunch(ckpt, ngram=(2, 4)))
    assert "--kv-cache-dtype" not in args
    spec = json.loads(args[args.index("--speculative-config") + 1])
    assert spec == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def test_an_int8_embedding_is_named_before_vllm_starts(tmp_path):
    from quantkit.server.vllm import caveat

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    qc = {"config_groups": {"group_0": {"targets": ["Linear"]}, "group_1": {"targets": ["model.embed_tokens"]}}}
    (ckpt / "config.json").write_text(json.dumps({"quantization_config": qc, "tie_word_embeddings": True}))
    assert "int8 embedding" in caveat(ckpt) and "tied" in caveat(ckpt)
    qc["config_groups"].pop("group_1")
    (ckpt / "config.json").write_text(json.dumps({"quantization_config": qc}))
    assert caveat(ckpt) is None


def test_vllm_missing_is_one_line(tiny_dir, capsys, monkeypatch):
    monkeypatch.delenv("QUANTKIT_VLLM", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    code, _, err = run_cli(capsys, "serve", str(tiny_dir), "--engine", "vllm")
    assert_one_line_error(code, err, "vLLM is not installed")
    code, _, err = run_cli(capsys, "serve", str(tiny_dir), "--tensor-parallel-size", "2")
    assert_one_line_error(code, err, "are for --engine vllm")
    with pytest.raises(Exception, match="no such file"):
        find_vllm("/nonexistent/vllm")


def test_serve_waits_for_vllm_forwards_sigterm_and_exits_with_it(tiny_dir, tmp_path):
    python, record = _fake_vllm(tmp_path)
    port = _free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "quantkit", "serve", str(tiny_dir), "--engine", "vllm", "--vllm", str(python),
                             "--port", str(port), "--served-model-name", "tiny", "--", "--enforce-eager"],
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        lines = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            lines.append(proc.stderr.readline())
            if "vLLM answers" in lines[-1] or proc.poll() is not None:
                break
        assert f"vLLM answers at http://127.0.0.1:{port}/v1" in lines[-1], "".join(lines)
        args = json.loads(record.read_text())
        assert args[:2] == ["--model", str(tiny_dir)] and args[-1] == "--enforce-eager"
        assert args[args.index("--served-model-name") + 1] == "tiny"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 3  # vLLM's exit status, after it got the signal
        assert record.with_name("args.json.signal").read_text() == str(int(signal.SIGTERM))
    finally:
        if proc.poll() is None:  # SIGTERM first: quantkit forwards it, so the stand-in does not outlive a failed test
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
