"""The server's Prometheus metrics (`GET /metrics`, text exposition format).

One registry per server rather than prometheus_client's global one, so two servers in one process (tests) do not
collide. Latencies are measured from the moment a request is queued, so TTFT includes time spent waiting for a
slot: that is what a client feels, and what `--max-batch` trades against throughput.

Speculation is counted per method (the policy each request ran, `method` label) in counters, so that the figures
vLLM's and llama.cpp's servers export are one PromQL division of two rates (docs/serve.md):
acceptance rate = accepted / drafted tokens, tokens per step (vLLM's "mean acceptance length") = emitted tokens /
steps. `arborspec_server_info` names what the server runs: its method, backends and models.
"""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

from ..engine import GenerationResult, StepStats

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
PER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
TOKENS_PER_STEP_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32)
RATE_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("arborspec_requests", "HTTP requests answered, by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.finished = Counter("arborspec_generations", "generations ended, by reason: stop, length, cancelled "
                                "(client gone), shutdown, error", ["reason"], registry=r)
        self.prompt_tokens = Counter("arborspec_prompt_tokens", "prompt tokens of finished generations", registry=r)
        self.generated_tokens = Counter("arborspec_generated_tokens", "tokens generated, counted every step "
                                        "(rate() = the server's tokens/s)", registry=r)
        self.latency = Histogram("arborspec_request_latency_seconds", "from queued to the last token",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("arborspec_time_to_first_token_seconds", "from queued to the first token (TTFT)",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("arborspec_time_per_output_token_seconds", "after the first token (TPOT)",
                              buckets=PER_TOKEN_BUCKETS, registry=r)
        self.tokens_per_s = Histogram("arborspec_request_tokens_per_second", "one request's decoding throughput",
                                      buckets=RATE_BUCKETS, registry=r)
        self.tokens_per_step = Histogram("arborspec_tokens_per_step", "tokens committed per speculative step "
                                         "(accepted + the target's bonus token)", buckets=TOKENS_PER_STEP_BUCKETS,
                                         registry=r)
        self.accepted_per_step = Histogram("arborspec_accepted_tokens_per_step", "drafted tokens the target "
                                           "accepted per step", buckets=TOKENS_PER_STEP_BUCKETS, registry=r)
        self.steps = Counter("arborspec_speculative_steps", "speculative steps (one target verification each), by "
                             "the method the request ran", ["method"], registry=r)
        self.drafted = Counter("arborspec_drafted_tokens", "drafted tokens the target verified (tree nodes), by method",
                               ["method"], registry=r)
        self.accepted = Counter("arborspec_accepted_tokens", "drafted tokens the target accepted, by method",
                                ["method"], registry=r)
        self.emitted = Counter("arborspec_emitted_tokens", "tokens committed by speculative steps (accepted + the "
                               "target's own token each; the prompt's forward's first token is no step's), by method",
                               ["method"], registry=r)
        self.info = Info("arborspec_server", "what this server runs: its method, the backends and the models",
                         registry=r)
        self.queue_depth = Gauge("arborspec_queue_depth", "requests waiting for a slot", registry=r)
        self.batch_size = Gauge("arborspec_batch_size", "requests being generated (advanced one step each round)",
                                registry=r)

    def step(self, step: StepStats, method: str = "") -> None:
        """One step of a request running `method` (its policy). The prompt's forward, which makes the first token,
        counts among the generated tokens and in no per-step figure (engine/stats.py: decoding steps)."""
        self.generated_tokens.inc(step.committed)
        if step.prefill:
            return
        self.tokens_per_step.observe(step.committed)
        self.accepted_per_step.observe(step.accepted)
        self.steps.labels(method=method).inc()
        self.drafted.labels(method=method).inc(step.tree_size)
        self.accepted.labels(method=method).inc(step.accepted)
        self.emitted.labels(method=method).inc(step.committed)

    def generation(self, result: GenerationResult, queued: float, first_token: float | None, end: float) -> None:
        """A generation that ran to its end; times are time.perf_counter() readings."""
        s = result.stats
        self.finished.labels(reason="length" if s.finish_reason in ("length", "context") else "stop").inc()
        self.prompt_tokens.inc(s.prompt_tokens)
        self.latency.observe(end - queued)
        if first_token is not None:
            self.ttft.observe(first_token - queued)
            if s.new_tokens > 1:
                self.tpot.observe((end - first_token) / (s.new_tokens - 1))
        if s.tokens_per_s > 0:
            self.tokens_per_s.observe(s.tokens_per_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
