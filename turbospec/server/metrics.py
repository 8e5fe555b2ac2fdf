"""Prometheus metrics with vLLM's names under a ``turbospec:`` prefix, so existing dashboards need only a
renamed prefix. Updated from the engine thread after every step; each server owns its registry.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from ..engine import LLMEngine
from ..outputs import RequestOutput

disable_created_metrics()  # no *_created series: vLLM does not export them and they double the scrape
PREFIX = "turbospec:"
# seconds; wide enough for a 1.5B model on two CPU cores and for a GPU
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                   20.0, 40.0, 80.0, 160.0)
K_BUCKETS = tuple(float(k) for k in range(17))


@dataclass
class _Timing:
    arrival: float
    last_token: float | None = None


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, [*labels, *extra], registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=r)

        self.running = gauge("num_requests_running", "Requests in the running batch")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full)")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that produced a first token")
        self.generation_tokens = counter("generation_tokens", "Generated tokens")
        self.preemptions = counter("num_preemptions", "Requests preempted (recomputed later) for KV space")
        self.finished = counter("request_success", "Finished requests by finish reason", ("finished_reason",))
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first generated token")
        self.itl = histogram("inter_token_latency_seconds", "Time between generated tokens, per token")
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to the last token")
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled")
        self.drafts = counter("spec_decode_num_drafts", "Request-steps that verified at least one draft token")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified")
        self.accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.relaxed = counter("spec_decode_num_relaxed_tokens",
                               "Draft tokens accepted only by a lossy acceptance policy (typical, adasd)")
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted, by position in the draft", ("position",))
        self.chosen_k = histogram("spec_decode_chosen_k", "Draft length given to a decoding request-step "
                                                          "(0 = none), by the controller or the fixed k", K_BUCKETS)
        self.acceptance_estimate = gauge("spec_decode_acceptance_estimate",
                                         "The goodput controller's mean first-position acceptance estimate")
        self.step_time_error = gauge("spec_decode_step_time_relative_error",
                                     "Mean relative error of the controller's step-time predictions")
        self.model_name = model_name
        for metric in (self.running, self.waiting, self.kv_usage, self.prompt_tokens, self.generation_tokens,
                       self.preemptions, self.ttft, self.itl, self.e2e, self.queue, self.drafts, self.draft_tokens,
                       self.accepted, self.chosen_k):
            metric.labels(model_name)  # exported at zero from the start, so a scrape sees every series
        self._timings: dict[str, _Timing] = {}
        self._spec_seen = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "relaxed": 0, "preemptions": 0}
        self._per_pos_seen: list[int] = []
        self._k_seen: list[int] = []

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def snapshot(self, speculation: str) -> dict[str, object]:
        """The numbers the web page polls (GET /stats): counters since start and the queue now."""
        def value(name: str) -> float:
            got = self.registry.get_sample_value(PREFIX + name, {"model_name": self.model_name})
            return got or 0.0

        return {"model": self.model_name, "speculation": speculation,
                "generation_tokens": int(value("generation_tokens_total")),
                "drafts": int(value("spec_decode_num_drafts_total")),
                "draft_tokens": int(value("spec_decode_num_draft_tokens_total")),
                "accepted_tokens": int(value("spec_decode_num_accepted_tokens_total")),
                "running": int(value("num_requests_running")), "waiting": int(value("num_requests_waiting"))}

    # --- called in the engine thread -----------------------------------------------------------------------

    def on_step(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        m = self.model_name
        now = time.monotonic()
        self.running.labels(m).set(len(engine.scheduler.running))
        self.waiting.labels(m).set(len(engine.scheduler.waiting))
        self.kv_usage.labels(m).set(engine.blocks.usage())
        for out in outputs:
            self._observe_request(out, now)
        self._observe_spec(engine)

    def _observe_request(self, out: RequestOutput, now: float) -> None:
        m, metrics = self.model_name, out.metrics
        if metrics is None:
            return
        timing = self._timings.setdefault(out.request_id, _Timing(metrics.arrival_time))
        n = len(out.delta_token_ids)
        if n:
            self.generation_tokens.labels(m).inc(n)
            if timing.last_token is None:
                self.ttft.labels(m).observe(now - timing.arrival)
                self.prompt_tokens.labels(m).inc(len(out.prompt_token_ids))
                if metrics.first_scheduled_time is not None:
                    self.queue.labels(m).observe(max(0.0, metrics.first_scheduled_time - timing.arrival))
                n -= 1  # the first token's latency is the TTFT
            else:
                gap = (now - timing.last_token) / n  # a step that emits several tokens spreads its time
                for _ in range(n):
                    self.itl.labels(m).observe(gap)
            timing.last_token = now
        if out.finished:
            self._timings.pop(out.request_id, None)
            reason = out.outputs[0].finish_reason or "unknown"
            self.finished.labels(m, reason).inc()
            self.e2e.labels(m).observe(now - timing.arrival)

    def _observe_spec(self, engine: LLMEngine) -> None:
        m, s, seen = self.model_name, engine.speculation.stats, self._spec_seen
        current = {"drafts": s.num_drafts, "draft_tokens": s.num_draft_tokens, "accepted": s.num_accepted_tokens,
                   "relaxed": s.num_relaxed_tokens, "preemptions": engine.scheduler.num_preemptions}
        if current["drafts"] < seen["drafts"]:  # the engine's statistics were reset: start counting again
            seen.update(drafts=0, draft_tokens=0, accepted=0, relaxed=0)
            self._per_pos_seen, self._k_seen = [], []
        for key, metric in (("drafts", self.drafts), ("draft_tokens", self.draft_tokens),
                            ("accepted", self.accepted), ("relaxed", self.relaxed), ("preemptions", self.preemptions)):
            if current[key] > seen[key]:
                metric.labels(m).inc(current[key] - seen[key])
        self._spec_seen = current
        for pos, count in enumerate(s.num_accepted_tokens_per_pos):
            before = self._per_pos_seen[pos] if pos < len(self._per_pos_seen) else 0
            if count > before:
                self.accepted_per_pos.labels(m, str(pos)).inc(count - before)
        self._per_pos_seen = list(s.num_accepted_tokens_per_pos)
        for k, count in enumerate(s.k_histogram):
            before = self._k_seen[k] if k < len(self._k_seen) else 0
            for _ in range(count - before):
                self.chosen_k.labels(m).observe(k)
        self._k_seen = list(s.k_histogram)
        if engine.speculation.controller is not None:
            stats = engine.speculation.controller.stats
            if stats.last_acceptance is not None:
                self.acceptance_estimate.labels(m).set(stats.last_acceptance)
            self.step_time_error.labels(m).set(stats.as_dict()["step_time_mean_relative_error"] or 0.0)
