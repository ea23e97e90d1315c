"""`metasd serve`: an OpenAI-compatible HTTP API over one Decoder, with SSE streaming and Prometheus metrics.

The Decoder is synchronous and stateful (KV cache, drafters, policies), so one worker thread owns it and decodes
up to --max-batch requests together (continuous batching, `metasd.batching`: one target forward per round for all
of them; requests join from a bounded FIFO queue and leave between rounds). The event loop only validates, queues
and relays events, so /health and /metrics answer while requests decode.

The modules, one concern each: `protocol` (request models, errors, limits), `stop_strings`, `metrics`
(Prometheus), `worker` (the decoding thread), `app` (`create_app` and its routes); this one launches uvicorn.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..batching import DEFAULT_MAX_BATCH, DEFAULT_PREFILL_SHARE
from ..engine import Decoder
from ..learning import LearningConfig
from .app import create_app
from .protocol import MAX_BODY_BYTES

__all__ = ["create_app", "serve"]


def serve(
    decoder: Decoder,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | Sequence[str] | None = None,
    max_queue: int = 64,
    max_body_bytes: int = MAX_BODY_BYTES,
    history_scope: str = "shared",
    max_batch: int = DEFAULT_MAX_BATCH,
    prefill_share: float = DEFAULT_PREFILL_SHARE,
    learning: LearningConfig | None = None,
    learn_dir: str | Path | None = None,
) -> None:
    """Run the server until interrupted (the `metasd serve` command)."""
    import uvicorn

    # On shutdown, give in-flight requests 10 s, then cancel them (which stops their jobs) rather than wait for
    # every queued generation to finish.
    app = create_app(
        decoder,
        api_key=api_key,
        max_queue=max_queue,
        max_body_bytes=max_body_bytes,
        history_scope=history_scope,
        max_batch=max_batch,
        prefill_share=prefill_share,
        learning=learning,
        learn_dir=learn_dir,
    )
    uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=10)
