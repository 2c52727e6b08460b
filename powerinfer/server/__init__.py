"""HTTP serving: llama.cpp- and OpenAI-compatible endpoints over one continuous-batching generation worker."""

from __future__ import annotations

import logging
import socket
import threading
from typing import Any

from powerinfer.printable import printable
from powerinfer.runtime.engine import Engine
from powerinfer.runtime.speculative import load_speculator
from powerinfer.server.app import ServerOptions, create_app
from powerinfer.server.limits import bind_socket, fit_connections, protocol_class
from powerinfer.server.state import ServerState
from powerinfer.server.worker import GenParams, GenRequest, Worker

__all__ = ["GenParams", "GenRequest", "Server", "ServerOptions", "Worker", "bind_socket", "create_app"]

log = logging.getLogger(__name__)


class Server:
    """Loads the model, starts the generation worker and serves the app with uvicorn.

    The listening socket is bound first (`sockets`: already bound ones, for tests), so that a busy or invalid
    address fails before the model loads. Connections get the limits of `limits.protocol_class` (read deadline,
    write stall limit, connection cap).

    On SIGINT/SIGTERM uvicorn stops accepting connections; requests in flight get `shutdown_grace_s`
    seconds to finish, then the worker stops and whatever still runs ends with a 503 error (an error event
    when streaming).
    """

    def __init__(
        self,
        options: ServerOptions,
        shutdown_grace_s: float = 5.0,
        sockets: list[socket.socket] | None = None,
    ) -> None:
        import uvicorn

        self.options = options
        own = sockets is None
        self.sockets = [bind_socket(options.host, options.port)] if sockets is None else sockets
        try:
            self.engine = Engine(options.model, options.engine)
        except BaseException:
            if own:
                for sock in self.sockets:
                    sock.close()
            raise
        try:
            spec = None if options.speculative is None else load_speculator(options.speculative, self.engine)
        except BaseException:
            if own:
                for sock in self.sockets:
                    sock.close()
            raise
        if spec is not None:
            log.info("speculative decoding: %s", spec.describe())
        self.worker = Worker(self.engine, options.max_queue, spec)
        self.app = create_app(self.worker, options)
        self.state: ServerState = self.app.app.state.server  # type: ignore[attr-defined]
        protocol = protocol_class(
            options.read_timeout_s, options.write_timeout_s, fit_connections(options.max_connections)
        )
        config = uvicorn.Config(
            self.app,
            host=options.host,
            port=options.port,
            http=protocol,
            log_config=None,
            timeout_graceful_shutdown=int(shutdown_grace_s) + 5,
            server_header=False,
        )
        worker = self.worker

        class _Uvicorn(uvicorn.Server):
            def handle_exit(self, sig: int, frame: Any) -> None:
                if not self.should_exit:
                    log.info(
                        "shutting down: %d request(s) in flight get %.0f s to finish",
                        worker.slots_busy(),
                        shutdown_grace_s,
                    )
                    timer = threading.Timer(shutdown_grace_s, worker.stop)
                    timer.daemon = True
                    timer.start()
                super().handle_exit(sig, frame)
                # uvicorn re-raises a captured signal after its graceful shutdown, which would end the process
                # by that signal; the shutdown was handled, so exit normally instead
                captured = getattr(self, "_captured_signals", None)
                if isinstance(captured, list):
                    captured.clear()

        self.uvicorn = _Uvicorn(config)

    def run(self, sockets: list[socket.socket] | None = None) -> None:
        """Serve until shut down (blocking). `sockets`: listening sockets to use instead of the bound ones."""
        sockets = sockets or self.sockets
        self.worker.start()
        o = self.options
        port = sockets[0].getsockname()[1] if sockets else o.port
        log.info(
            "serving %s on http://%s:%d with %d slots, context %d, queue %d%s",
            printable(o.model.name),
            printable(o.host),
            port,
            self.worker.n_slots,
            self.worker.n_ctx,
            o.max_queue,
            ", API key required" if o.api_key else "",
        )
        try:
            self.uvicorn.run(sockets=sockets)
        finally:
            self.worker.stop()
            self.state.grammars.close()

    def shutdown(self) -> None:
        """Ask a running server to exit (from another thread)."""
        self.uvicorn.should_exit = True
