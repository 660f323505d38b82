"""Prometheus metrics of the server, in a registry of its own (several apps may live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from hierspec.decode import GenerationResult

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class ServerMetrics:
    """Requests, tokens, mean accepted tokens per target forward, queue length and latencies."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("hierspec_requests", "HTTP requests by path and status", ["path", "status"],
                                registry=self.registry)
        self.latency = Histogram("hierspec_request_latency_seconds",
                                 "HTTP latency by path until the response starts (a stream's headers)", ["path"],
                                 buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.end_to_end = Histogram("hierspec_generation_request_seconds",
                                    "time from queueing a generation to its last token", buckets=_LATENCY_BUCKETS,
                                    registry=self.registry)
        self.queue_wait = Histogram("hierspec_queue_wait_seconds", "time a generation waited in the queue",
                                    buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.generation_time = Histogram("hierspec_generation_seconds", "time spent generating one request",
                                         buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.prompt_tokens = Counter("hierspec_prompt_tokens", "prompt tokens processed", registry=self.registry)
        self.generated_tokens = Counter("hierspec_generated_tokens", "tokens generated", registry=self.registry)
        self.target_forwards = Counter("hierspec_target_forwards", "verification forwards of the target model",
                                       registry=self.registry)
        self.mean_accepted = Gauge("hierspec_mean_accepted_tokens",
                                   "tokens generated per target forward since start (MAT)", registry=self.registry)
        self.queue_length = Gauge("hierspec_queue_length", "requests waiting for the model", registry=self.registry)
        self.degraded = Gauge("hierspec_degraded_conditions", "conditions degrading the server without failing "
                              "requests (e.g. a learning store that cannot be written; see /health)",
                              registry=self.registry)
        self.cancelled = Counter("hierspec_cancelled_generations", "generations stopped early (client gone or timeout)",
                                 registry=self.registry)
        self._tokens = 0
        self._forwards = 0

    def observe_request(self, path: str, status: int, seconds: float) -> None:
        """Count one request; ``path`` is a route label from a fixed set (the server's routes or "other")."""
        self.requests.labels(path, str(status)).inc()
        self.latency.labels(path).observe(seconds)

    def observe_generation(self, queued_s: float, generating_s: float, result: GenerationResult | None,
                           prompt_tokens: int) -> None:
        self.queue_wait.observe(queued_s)
        self.generation_time.observe(generating_s)
        self.end_to_end.observe(queued_s + generating_s)
        if result is None:
            self.cancelled.inc()
            return
        self.prompt_tokens.inc(prompt_tokens)
        self.generated_tokens.inc(len(result.token_ids))
        self.target_forwards.inc(result.stats.target_forwards)
        self._tokens += len(result.token_ids)
        self._forwards += result.stats.target_forwards
        if self._forwards:
            self.mean_accepted.set(self._tokens / self._forwards)
