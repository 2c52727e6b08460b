"""The worker ranks of a pipeline started from the command line.

`torchrun --nnodes N --nproc-per-node K --master-addr HOST --master-port PORT ... -m powerinfer main ...`
starts the same command on every rank. Rank 0 runs the command; every other rank builds its stage of the
model and serves rank 0's steps until rank 0 stops (`serve_if_worker`), then the command ends with code 0.
"""

from __future__ import annotations

import logging
from pathlib import Path

from powerinfer.runtime.engine import Engine, EngineOptions
from powerinfer.runtime.threads import torch_threads

log = logging.getLogger(__name__)


def serve_if_worker(model: Path, options: EngineOptions) -> bool:
    """On ranks > 0: build this rank's stage, serve rank 0's steps until it stops, return True.
    On rank 0 and single processes: return False at once."""
    p = options.pipeline
    if p is None or p.env.rank == 0:
        return False
    engine = Engine(model, options)
    assert engine.pipeline is not None and engine.stage is not None
    log.info("%s; this is rank %d", engine.stage.describe(), p.env.rank)
    with torch_threads(engine.kc.threads_now):  # this process serves one engine: torch at its count
        n_steps = engine.pipeline.serve(engine)
    log.info("pipeline rank %d: %d steps served", p.env.rank, n_steps)
    return True
