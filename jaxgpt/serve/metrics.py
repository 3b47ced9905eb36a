"""The server's Prometheus metrics (prometheus-client), served at /metrics.

Each app has a registry of its own, so several servers in one process (the tests) count apart. Queue depth and
busy slots are the engine's last report (`EngineClient.state`) when scraped; latencies are observed where the
handler receives each token. With `jaxgpt serve --api_servers N`, each front end counts its own requests and
tokens (a scrape reaches one of them); the engine's gauges are the same in all.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from jaxgpt.serve.client import EngineClient

# seconds: from a few milliseconds (a small model's token on an accelerator) to a minute (a long queue)
_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self, engine: EngineClient, slots: int) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("jaxgpt_requests", "HTTP requests answered, by path and status",
                                ("path", "status"), registry=self.registry)
        self.prompt_tokens = Counter("jaxgpt_prompt_tokens", "prompt tokens prefilled", registry=self.registry)
        self.generated_tokens = Counter("jaxgpt_generated_tokens", "tokens generated", registry=self.registry)
        queue = Gauge("jaxgpt_queue_depth", "requests waiting for a slot", registry=self.registry)
        queue.set_function(lambda: engine.state[0])
        busy = Gauge("jaxgpt_busy_slots", "slots decoding a request", registry=self.registry)
        busy.set_function(lambda: engine.state[1])
        Gauge("jaxgpt_slots", "slots in all", registry=self.registry).set(slots)
        self.first_token = Histogram("jaxgpt_time_to_first_token_seconds",
                                     "from a request's arrival to its first generated token", buckets=_LATENCY,
                                     registry=self.registry)
        self.inter_token = Histogram("jaxgpt_inter_token_latency_seconds",
                                     "between consecutive tokens of one choice", buckets=_LATENCY,
                                     registry=self.registry)
