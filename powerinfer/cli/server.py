"""`powerinfer server`: llama.cpp- and OpenAI-compatible HTTP server with continuous batching."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, ClassVar

import typer

from powerinfer.app.pipeline import serve_if_worker
from powerinfer.cli.common import run_guarded, setup_logging
from powerinfer.cli.options import (
    ContextShiftArgs,
    EngineArgs,
    LogDisableOpt,
    SamplingArgs,
    SpeculativeArgs,
    takes,
)
from powerinfer.errors import InputError
from powerinfer.runtime.context_shift import check_keep

if TYPE_CHECKING:
    from powerinfer.server import ServerOptions


@dataclass(frozen=True)
class ServerArgs:
    """The options of the server itself: address, slots, limits, template."""

    PANEL: ClassVar[str] = "Server"

    host: Annotated[str, typer.Option("--host", help="Address to bind (loopback by default).")] = "127.0.0.1"
    port: Annotated[int, typer.Option("--port", help="TCP port.", envvar="PORT")] = 8080
    parallel: Annotated[
        int, typer.Option("-np", "--parallel", help="KV slots: sequences decoded together.")
    ] = 4
    n_predict: Annotated[
        int, typer.Option("-n", "--n-predict", help="Default token limit of a request (-1 = until EOS).")
    ] = -1
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key",
            envvar="POWERINFER_API_KEY",
            show_default=False,
            help="Require 'Authorization: Bearer KEY' (401 otherwise).",
        ),
    ] = None
    timeout: Annotated[
        float, typer.Option("-to", "--timeout", help="Seconds a request may wait plus generate.")
    ] = 600.0
    alias: Annotated[
        str | None,
        typer.Option(
            "-a",
            "--alias",
            help="Model id listed by /v1/models and echoed in every response's 'model' (default: the file "
            "name); requests may name any model, the loaded one serves them all.",
            show_default=False,
        ),
    ] = None
    max_queue: Annotated[
        int, typer.Option("--max-queue", help="Requests waiting beyond the slots (503 past it).")
    ] = 32
    max_body: Annotated[
        int, typer.Option("--max-body", help="Largest request body in bytes (413 past it).")
    ] = 1 << 20
    chat_template: Annotated[
        Path | None,
        typer.Option(
            "--chat-template-file", show_default=False, help="Jinja2 chat template replacing the model's."
        ),
    ] = None
    n_predict_max: Annotated[
        int,
        typer.Option(
            "--n-predict-max", help="Cap on any request's token limit (-1 = only the context limits it)."
        ),
    ] = -1
    read_timeout: Annotated[
        float,
        typer.Option(
            "--read-timeout",
            help="Seconds a connection has to deliver a whole request (line, headers, body); closed past it.",
        ),
    ] = 20.0
    write_timeout: Annotated[
        float,
        typer.Option(
            "--write-timeout",
            help="Seconds a response may stall on a client that does not read; aborted past it.",
        ),
    ] = 60.0
    max_connections: Annotated[
        int,
        typer.Option(
            "--max-connections",
            help="Open connections; past it the oldest one without a complete request is closed (503 if none).",
        ),
    ] = 512
    embedding: Annotated[
        bool,
        typer.Option(
            "--embedding",
            help="Serve POST /v1/embeddings and /embedding: the mean of the final-normed hidden states over "
            "the input's tokens (or the GGUF's pooling type), L2-normalised.",
        ),
    ] = False

    def options(
        self,
        engine: EngineArgs,
        sampling: SamplingArgs,
        shift: ContextShiftArgs | None = None,
        speculative: SpeculativeArgs | None = None,
    ) -> ServerOptions:
        """ServerOptions, every limit checked first (one InputError line each), then the model resolved."""
        from powerinfer.server import ServerOptions

        if self.parallel < 1:
            raise InputError(f"-np/--parallel must be >= 1 (got {self.parallel})")
        if self.max_queue < 0 or self.max_body < 1:
            raise InputError("--max-queue must be >= 0 and --max-body >= 1")
        if not 0 <= self.port <= 65535:
            raise InputError(f"--port must be in 0..65535 (0: any free port), got {self.port}")
        if not (0 < self.read_timeout < math.inf and 0 < self.write_timeout < math.inf):
            raise InputError("--read-timeout and --write-timeout must be positive numbers of seconds")
        if self.max_connections < 1 or self.n_predict_max < -1:
            raise InputError("--max-connections must be >= 1 and --n-predict-max >= -1")
        shift = (shift or ContextShiftArgs(context_shift=False)).checked()
        if engine.ctx_size > 0:
            check_keep(shift.keep, engine.ctx_size)
        template = None
        if self.chat_template is not None:
            try:
                template = self.chat_template.read_text(encoding="utf-8")
            except OSError as e:
                raise InputError(f"cannot read chat template {self.chat_template}: {e.strerror}") from None
        return ServerOptions(
            model=engine.model_path(),
            engine=engine.options(n_seq=self.parallel),
            sampling=sampling.params(),
            n_predict=self.n_predict,
            host=self.host,
            port=self.port,
            api_key=self.api_key or None,
            timeout_s=self.timeout,
            alias=self.alias,
            max_queue=self.max_queue,
            max_body_bytes=self.max_body,
            chat_template=template,
            n_predict_max=self.n_predict_max,
            read_timeout_s=self.read_timeout,
            write_timeout_s=self.write_timeout,
            max_connections=self.max_connections,
            embedding=self.embedding,
            context_shift=shift.context_shift,
            n_keep=shift.keep,
            speculative=None if speculative is None else speculative.options(),
        )


@takes(ServerArgs, EngineArgs, SamplingArgs, ContextShiftArgs, SpeculativeArgs, context_shift=False)
def server(
    http: ServerArgs,
    engine: EngineArgs,
    sampling: SamplingArgs,
    shift: ContextShiftArgs,
    speculative: SpeculativeArgs,
    log_disable: LogDisableOpt = False,
) -> None:
    """Serve a model over HTTP (llama.cpp server endpoints plus the OpenAI API)."""
    setup_logging(log_disable)

    def body() -> None:
        from powerinfer.server import Server

        opts = http.options(engine, sampling, shift, speculative)
        if not serve_if_worker(opts.model, opts.engine):  # ranks > 0 of a pipeline serve rank 0, then exit
            Server(opts).run()

    run_guarded(body)
