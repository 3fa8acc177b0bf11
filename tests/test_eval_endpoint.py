"""`quantkit eval --backend endpoint`: the quantized model behind an OpenAI-compatible server.

The server here is a small real HTTP server on a loopback port that answers `/v1/models` and
`/v1/completions` by greedy generation with HF transformers, records what it was sent, and checks the
bearer key: enough to prove what the eval client sends and how it reads the answers.
"""

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from quantkit.eval.backends import HFBackend
from tests.conftest import run_cli

KEY = "sekret"


class Server:
    def __init__(self, path):
        self.model = HFBackend(path, "served", batch_size=1)
        self.lock = threading.Lock()
        self.replies: dict[str, str] = {}
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _authorized(self):
                if self.headers.get("Authorization") == f"Bearer {KEY}":
                    return True
                self._send(401, {"error": {"message": "invalid api key", "type": "invalid_request_error"}})
                return False

            def do_GET(self):
                if self._authorized():
                    self._send(200, {"object": "list", "data": [{"id": "tiny-w4", "object": "model"}]})

            def do_POST(self):
                if not self._authorized():
                    return
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                assert body["model"] == "tiny-w4" and body["temperature"] == 0.0
                with server.lock:
                    text = server.model.generate([body["prompt"]], body["max_tokens"])[0]
                    server.replies[body["prompt"]] = text
                self._send(200, {"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": "length"}]})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def served(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("served") / "q"
    done = subprocess.run([sys.executable, "-m", "quantkit", "quantize", str(tiny_dir), "-o", str(out), "-g", "32", "-q"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    server = Server(out)
    yield out, server
    server.httpd.shutdown()


def test_endpoint_backend_runs_generation_tasks(served, tmp_path, capsys):
    ckpt, server = served
    code, stdout, err = run_cli(capsys, "eval", str(ckpt), "--backend", "endpoint", "--endpoint", server.url, "--api-key", KEY,
                                "--lengths", "128", "--limit", "2", "--out", str(tmp_path / "ev"), "--json", "--no-cache")
    assert code == 0, err
    assert {r["task"] for r in json.loads(stdout)["summary"]} == {"retrieval", "tool-use"}  # no logits from an endpoint
    items = json.loads((tmp_path / "ev/results.json").read_text())["items"]
    assert len(items) == 9 * 2 + 2 and len(server.replies) == len(items)
    assert sorted(i["quantized"]["output"] for i in items) == sorted(server.replies.values())


def test_endpoint_errors_are_one_line(served, tmp_path, capsys):
    ckpt, server = served
    code, _, err = run_cli(capsys, "eval", str(ckpt), "--endpoint", server.url, "--out", str(tmp_path / "ev"))
    assert code == 2 and "401" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_cli(capsys, "eval", str(ckpt), "--endpoint", server.url, "--api-key", KEY, "--tasks", "kl",
                           "--out", str(tmp_path / "ev"))
    assert code == 2 and "full logits" in err
    code, _, err = run_cli(capsys, "eval", str(ckpt), "--endpoint", "http://127.0.0.1:9/v1", "--out", str(tmp_path / "ev"))
    assert code == 2 and "unreachable" in err
