"""Start the server: load the engine, put the API in front of it, and run uvicorn in a thread while the
main thread steps the engine.

On SIGINT/SIGTERM uvicorn stops accepting connections and lets in-flight requests finish for up to
`drain_seconds` (the engine keeps stepping meanwhile); whatever is still running after that ends as
aborted, and the process exits 0. A second signal skips the drain.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

from quantkit.runtime.engine import EngineConfig, LLMEngine
from quantkit.server.api import ServerConfig, build_app
from quantkit.server.async_engine import AsyncEngine


def serve(path: Path, engine_cfg: EngineConfig, cfg: ServerConfig, host: str = "127.0.0.1", port: int = 8000,
          drain_seconds: int = 30, announce=print) -> None:
    import uvicorn

    llm = LLMEngine(path, engine_cfg)
    engine = AsyncEngine(llm, cfg.max_waiting)
    config = uvicorn.Config(build_app(engine, cfg), host=host, port=port, log_level="warning",
                            timeout_graceful_shutdown=drain_seconds, access_log=False)
    server = uvicorn.Server(config)

    def http() -> None:
        try:
            server.run()
        finally:
            engine.shutdown()  # the HTTP side is done (drained, or failed to start): stop stepping

    def stop(*_) -> None:  # the first signal drains; a second one stops at once
        server.force_exit = server.should_exit
        server.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    thread = threading.Thread(target=http, name="quantkit-http", daemon=True)
    thread.start()  # uvicorn starts while the engine warms up: a request in that moment queues for `run_forever`
    llm.warm_up()
    announce(llm.describe())
    while not server.started and thread.is_alive():  # "ready" once it listens (a port in use ends the thread)
        time.sleep(0.01)
    if server.started:
        announce(f"serving {cfg.served_model_name} at http://{host}:{port}/v1" + (" (API key required)" if cfg.api_key else ""))
        announce(llm.startup(then="listen"))
    engine.run_forever()
    thread.join(5)
