"""Pipeline stages from the command line: the options every engine command shares, and the worker ranks' loop.

`torchrun --nnodes N --nproc-per-node K --master-addr HOST --master-port PORT ... -m powerinfer main ...`
starts the same command on every rank. Rank 0 runs the command; every other rank builds its stage of the
model and serves rank 0's steps until rank 0 stops (`serve_if_worker`), then exits with code 0.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from powerinfer.runtime.engine import EngineOptions
    from powerinfer.runtime.pipeline import PipelineOptions

log = logging.getLogger(__name__)

PipelineSplitOpt = Annotated[
    str | None,
    typer.Option(
        "--pipeline-split",
        envvar="POWERINFER_PIPELINE_SPLIT",
        help="Under torchrun: layers per pipeline stage in rank order, e.g. 10,12 (default: balanced by bytes).",
        show_default=False,
    ),
]
DistTimeoutOpt = Annotated[
    float,
    typer.Option(
        "--dist-timeout",
        envvar="POWERINFER_DIST_TIMEOUT",
        help="Under torchrun: seconds a rank waits for the others to join and for a peer within a step.",
    ),
]
DEFAULT_DIST_TIMEOUT = 60.0


def pipeline(split: str | None, timeout_s: float) -> PipelineOptions | None:
    """The pipeline stage options of this process (None unless torchrun started several ranks)."""
    from powerinfer.runtime.pipeline import pipeline_options

    return pipeline_options(split, timeout_s, os.environ)


def serve_if_worker(model: Path, options: EngineOptions) -> None:
    """On ranks > 0: build this rank's stage, serve rank 0's steps until it stops, exit with code 0.
    On rank 0 and single processes: return at once."""
    p = options.pipeline
    if p is None or p.env.rank == 0:
        return
    from powerinfer.runtime.engine import Engine

    engine = Engine(model, options)
    assert engine.pipeline is not None and engine.stage is not None
    log.info("%s; this is rank %d", engine.stage.describe(), p.env.rank)
    n_steps = engine.pipeline.serve(engine)
    log.info("pipeline rank %d: %d steps served", p.env.rank, n_steps)
    raise typer.Exit(0)
