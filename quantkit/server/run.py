"""Start the server: load the engine, put the API in front of it, run uvicorn until a signal.

On SIGINT/SIGTERM uvicorn stops accepting connections and lets in-flight requests finish for up to
`drain_seconds`; whatever is still running after that ends as aborted, and the engine thread stops.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from quantkit.runtime.engine import EngineConfig, LLMEngine
from quantkit.server.api import ServerConfig, build_app
from quantkit.server.async_engine import AsyncEngine


def serve(path: Path, engine_cfg: EngineConfig, cfg: ServerConfig, host: str = "127.0.0.1", port: int = 8000,
          drain_seconds: int = 30, announce=print) -> None:
    import uvicorn

    engine = LLMEngine(path, engine_cfg)
    app = build_app(AsyncEngine(engine, cfg.max_waiting), cfg)
    announce(engine.describe())
    announce(f"serving {cfg.served_model_name} at http://{host}:{port}/v1" + (" (API key required)" if cfg.api_key else ""))
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=drain_seconds,
                            access_log=False)
    # uvicorn drains on SIGTERM, then re-raises the signal with the handler found at start: make that an exit 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    uvicorn.Server(config).run()
