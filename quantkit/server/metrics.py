"""Prometheus text for /metrics: counters and latency histograms, under vLLM's metric names with the
`quantkit:` prefix (so a vLLM dashboard works after renaming the prefix)."""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


@dataclass(slots=True)
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    total: float = 0.0
    n: int = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out, running = [], 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts):
            running += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            out.append(f'{name}_bucket{{{labels},le="{le}"}} {running}')
        return out + [f"{name}_sum{{{labels}}} {self.total}", f"{name}_count{{{labels}}} {self.n}"]


@dataclass(slots=True)
class Metrics:
    ttft: Histogram = field(default_factory=Histogram)
    itl: Histogram = field(default_factory=Histogram)
    tpot: Histogram = field(default_factory=Histogram)
    e2e: Histogram = field(default_factory=Histogram)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finish_reasons: Counter = field(default_factory=Counter)

    def finished(self, reason: str) -> None:
        self.finish_reasons[reason] += 1

    def render(self, model: str, snapshot, rejected: int) -> str:
        """The exposition text; `snapshot` is the engine's state after its latest step."""
        lab = f'model_name="{model}"'
        usage = snapshot.kv_blocks_used / max(snapshot.kv_blocks_total, 1)
        hit = snapshot.prefix_cache_hits / snapshot.prefix_cache_queries if snapshot.prefix_cache_queries else 0.0
        gauges = [
            ("num_requests_running", "gauge", "Requests in the running batch.", snapshot.running),
            ("num_requests_waiting", "gauge", "Requests waiting for a slot.", snapshot.waiting),
            ("kv_cache_usage_perc", "gauge", "Fraction of KV-cache blocks in use (1 = full).", usage),
            ("prefix_cache_hit_rate", "gauge", "Prefix-cache block hits per block queried.", hit),
            ("prefix_cache_queries_total", "counter", "Prefix-cache blocks queried.", snapshot.prefix_cache_queries),
            ("prefix_cache_hits_total", "counter", "Prefix-cache blocks found.", snapshot.prefix_cache_hits),
            ("num_preemptions_total", "counter", "Sequences preempted (recomputed later) for lack of KV blocks.", snapshot.preemptions),
            ("prompt_tokens_total", "counter", "Prompt tokens admitted.", self.prompt_tokens),
            ("generation_tokens_total", "counter", "Tokens generated.", self.generation_tokens),
            ("request_rejected_total", "counter", "Requests answered 429 (waiting queue full).", rejected),
            ("spec_decode_num_drafts_total", "counter", "Sequence steps that verified draft tokens.", snapshot.spec_drafts),
            ("spec_decode_num_draft_tokens_total", "counter", "Draft tokens verified.", snapshot.spec_draft_tokens),
            ("spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.", snapshot.spec_accepted_tokens),
        ]
        out = []
        for name, kind, help_, value in gauges:
            out += [f"# HELP quantkit:{name} {help_}", f"# TYPE quantkit:{name} {kind}", f"quantkit:{name}{{{lab}}} {value}"]
        out += ["# HELP quantkit:spec_decode_num_accepted_tokens_per_pos_total Draft tokens accepted, by draft position.",
                "# TYPE quantkit:spec_decode_num_accepted_tokens_per_pos_total counter"]
        out += [f'quantkit:spec_decode_num_accepted_tokens_per_pos_total{{{lab},position="{i}"}} {n}'
                for i, n in enumerate(snapshot.spec_accepted_per_pos)]
        out += ["# HELP quantkit:request_success_total Finished requests by reason.", "# TYPE quantkit:request_success_total counter"]
        out += [f'quantkit:request_success_total{{{lab},finished_reason="{r}"}} {n}' for r, n in sorted(self.finish_reasons.items())]
        for name, hist, help_ in [("time_to_first_token_seconds", self.ttft, "Time to first token."),
                                  ("inter_token_latency_seconds", self.itl, "Time between output tokens."),
                                  ("request_time_per_output_token_seconds", self.tpot, "Per request: (last - first token) / (tokens - 1)."),
                                  ("e2e_request_latency_seconds", self.e2e, "Arrival to finish.")]:
            out += [f"# HELP quantkit:{name} {help_}", f"# TYPE quantkit:{name} histogram", *hist.lines(f"quantkit:{name}", lab)]
        return "\n".join(out) + "\n"
