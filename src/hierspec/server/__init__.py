"""OpenAI-compatible HTTP server: ``hierspec serve`` (engine, schemas, app, metrics)."""

from __future__ import annotations

import time
from collections.abc import Callable

from hierspec.batching import BatchConfig, BatchScheduler
from hierspec.drafters import Drafter
from hierspec.server.app import ServerConfig, create_app
from hierspec.server.engine import Engine
from hierspec.server.metrics import ServerMetrics
from hierspec.target import TargetModel

__all__ = ["ServerConfig", "build_app", "serve"]


def build_app(target: TargetModel, drafter: Drafter | Callable[[], Drafter], config: ServerConfig):
    """The FastAPI app and its engine (call ``engine.close()`` when done).

    ``drafter``: a function returning a new drafter of the method (one per concurrent generation, up to
    ``config.max_batch``), or one drafter instance — which serves one generation at a time (no batching).
    """
    metrics = ServerMetrics()

    def finished(job, result) -> None:
        started = job.started if job.started is not None else time.monotonic()
        metrics.observe_generation(started - job.enqueued, time.monotonic() - started, result, len(job.prompt_ids))

    if isinstance(drafter, Drafter):
        only, batch = drafter, BatchConfig(max_batch=1, max_rows=config.max_rows)
        new_drafter = lambda: only  # noqa: E731 — a single drafter: built once, reused by one generation at a time
    else:
        new_drafter, batch = drafter, BatchConfig(max_batch=config.max_batch, max_rows=config.max_rows)
    engine = Engine(BatchScheduler(target, new_drafter, batch), config.max_queue, config.timeout_s,
                    on_finish=finished)
    return create_app(target, engine, config, metrics), engine


def serve(target: TargetModel, drafter: Drafter | Callable[[], Drafter], config: ServerConfig,
          host: str = "127.0.0.1", port: int = 8000) -> None:
    """Run the server until interrupted."""
    import uvicorn

    from hierspec.gc_pauses import freeze_long_lived, thaw

    app, engine = build_app(target, drafter, config)
    described = engine.drafter.describe()
    freeze_long_lived()  # with the stores the drafter opened (gc_pauses.py)
    extras = ", ".join(f"{k}: {v}" for k, v in described.items() if k not in {"name", "config"})
    print(f"hierspec: serving {config.model_name!r} with method {described.get('name')}"
          f"{f' ({extras})' if extras else ''}; up to {engine.scheduler.max_batch} requests batched; "
          f"API key {'required' if config.api_key else 'off'}", flush=True)
    try:
        uvicorn.run(app, host=host, port=port, log_level="info")
    finally:
        engine.close()
        thaw()
