"""An OpenAI-compatible HTTP server over the AsyncEngine (chapter 09): running it.

    minivllm serve --model target --port 8000
    curl localhost:8000/v1/completions -H 'content-type: application/json' \\
         -d '{"model": "target", "prompt": "ROMEO:\\n", "max_tokens": 40}'

The server is five modules, one job each:

- `app.py`: `build_app`, a FastAPI app with OpenAI's endpoints -- `/v1/completions`,
  `/v1/chat/completions`, `/v1/models` (and `/v1/models/{id}`) --, Anthropic's `/v1/messages`,
  vLLM's `/tokenize`, `/detokenize` and `/version`, forge-infer's native `/generate` (one prompt
  in, `{text, token_ids, finish_reason}` out), and `/health` (with astrai's `model_loaded`),
  `/metrics` (Prometheus) and astrai's `/stats` (the engine's counters as JSON); every error in the
  API's own body;
- `endpoints.py`: the handlers, every check before the engine sees a request;
- `responses.py`: the answers, whole or as Server-Sent Events, and a client's disconnect;
- `connections.py`: what one connection may take (a deadline to send its request, a cap on
  connections, a deadline to read its response) and what the log takes of failures;
- this module: `ServerThread` runs all of it in a background thread on a free loopback port, for
  notebooks and tests; `serve` runs it in the foreground for the command line, and returns 1 if
  the engine died.
"""

from __future__ import annotations

import gc
import logging
import socket
import threading
import time

import uvicorn

from minivllm.engine.llm_engine import LLMEngine
from minivllm.serving.app import build_app
from minivllm.serving.async_engine import AsyncEngine, EngineDeadError
from minivllm.serving.connections import ConnectionStats, guarded_protocol, install_log_filters
from minivllm.serving.limits import ConnectionLimits, ServerLimits
from minivllm.serving.metrics import ServingMetrics

__all__ = ["ServerThread", "build_app", "serve"]
logger = logging.getLogger("minivllm.serving")


class ServerThread:
    """The server in a background thread, on a free loopback port (port 0: the OS picks one).

        with ServerThread(LLMEngine(load_model("target"))) as server:
            client = openai.OpenAI(base_url=server.base_url, api_key="unused")
            ...
            server.engine.blocks_in_use(), server.engine.trace()

    On exit uvicorn shuts down, then the AsyncEngine closes: no thread is left behind.

    While it runs, the process's heap as it was at start is frozen out of the garbage collector's
    view, as `serve` freezes it: a full collection walks every tracked object while holding the GIL
    the engine and every stream need. With a million objects alive beside the server one took
    0.41 s, and every stream stalled for it (0.015 s frozen); a test process's heap is bigger.
    Unfrozen when the last server stops, so nothing is kept for good.
    """

    _frozen_by = 0  # servers running: the heap is unfrozen when the last one stops
    _freeze_lock = threading.Lock()

    def __init__(
        self,
        engine: LLMEngine,
        model_name: str = "target",
        host: str = "127.0.0.1",
        port: int = 0,
        log_level: str = "warning",
        limits: ServerLimits | None = None,
        api_key: str | None = None,
        connections: ConnectionLimits | None = None,
    ) -> None:
        self.model_name, self.host = model_name, host
        self._socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._socket.bind((host, port))  # bound here, so the port is ours before uvicorn starts
        except OSError:
            self._socket.close()
            raise
        self.port = self._socket.getsockname()[1]
        self.engine = AsyncEngine(engine, ServingMetrics(model_name))
        self.connection_stats = ConnectionStats()
        config = uvicorn_config(
            build_app(self.engine, model_name, limits, api_key),
            connections or ConnectionLimits(),
            self.connection_stats,
            log_config=None,
            log_level=log_level,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=5,
        )
        self._server = uvicorn.Server(config)
        self._frozen = False  # whether this server holds the heap frozen (start, until stop)
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [self._socket]},
            name="minivllm-http",
            daemon=True,
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        """What the openai client takes as `base_url`."""
        return f"{self.url}/v1"

    def start(self, timeout: float = 30) -> ServerThread:
        with ServerThread._freeze_lock:
            ServerThread._frozen_by += 1
            self._frozen = True
            gc.freeze()  # unlike `serve`, no gc.collect() first: garbage frozen now waits for stop
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:  # uvicorn sets it once it listens
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start on {self.url} within {timeout} s")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join()
        self._socket.close()
        self.engine.close()
        with ServerThread._freeze_lock:
            if self._frozen:
                self._frozen = False
                ServerThread._frozen_by -= 1
                if ServerThread._frozen_by == 0:
                    gc.unfreeze()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


def uvicorn_config(
    app, connections: ConnectionLimits, stats: ConnectionStats, **options
) -> uvicorn.Config:
    """uvicorn's settings with the connection guards of `connections` (counted in `stats`)."""
    config = uvicorn.Config(app, http=guarded_protocol(connections, stats), **options)
    install_log_filters(connections)  # after Config, which sets up uvicorn's loggers
    return config


def serve(
    engine: LLMEngine,
    model_name: str = "target",
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    limits: ServerLimits | None = None,
    api_key: str | None = None,
    connections: ConnectionLimits | None = None,
    stall_timeout: float = 60.0,
    max_trace_bytes: int = 64 << 20,
) -> int:
    """Serve in the foreground until Ctrl-C (the `minivllm serve` command). Returns 0, or 1 when
    the engine died: the server stops at once so that a supervisor restarts it (as vLLM V1)."""
    # Everything alive now (model, libraries) lives as long as the process: take it out of the
    # garbage collector's view, or each full collection walks it all while holding the GIL the
    # engine needs.
    gc.collect()
    gc.freeze()
    async_engine = AsyncEngine(
        engine,
        ServingMetrics(model_name),
        max_trace_bytes=max_trace_bytes,
        stall_timeout=stall_timeout,
    )
    app = build_app(async_engine, model_name, limits, api_key)
    options = {"host": host, "port": port, "log_level": log_level}
    config = uvicorn_config(app, connections or ConnectionLimits(), ConnectionStats(), **options)
    server = uvicorn.Server(config)

    def stop_serving(error: EngineDeadError) -> None:
        logger.critical("the engine died (%s): the server stops", error)
        server.should_exit = True  # uvicorn checks it a few times a second

    async_engine.on_death.append(stop_serving)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn shuts down, then raises Ctrl-C again: the normal end
        pass
    finally:
        died = async_engine.error is not None  # before close(), only a failure sets it
        async_engine.close()
    return 1 if died else 0
