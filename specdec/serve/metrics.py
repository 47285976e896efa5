"""The server's Prometheus metrics, in a registry of their own per app (tests run several servers).

Names take vLLM's and llama.cpp server's, under a ``specdec:`` prefix, so that dashboards built
for either read ours with the prefix changed.  Counters are exposed with a ``_total`` suffix.

=======================================================  =====================  ======================================
specdec:<name>                                           vLLM: vllm:<name>      llama.cpp server: llamacpp:<name>
=======================================================  =====================  ======================================
spec_decode_num_drafts_total                             the same               the same
spec_decode_num_draft_tokens_total                       the same               the same
spec_decode_num_accepted_tokens_total                    the same               the same
spec_decode_num_accepted_tokens_per_pos_total            the same, {position}   the same, {position}
spec_decode_num_tree_drafts_total                        -                      -
spec_decode_num_tree_nodes_total                         -                      -
spec_decode_num_drafts_by_source_total{source}           -                      -
spec_decode_num_draft_tokens_by_source_total{source}     -                      -
spec_decode_num_accepted_tokens_by_source_total{source}  -                      -
prompt_tokens_total                                      the same               the same
generation_tokens_total                                  the same               tokens_predicted_total
tokens_predicted_seconds_total                           -                      the same
predicted_tokens_seconds                                 -                      the same
n_decode_total                                           -                      the same
num_requests_running, num_requests_waiting               the same               requests_processing, requests_deferred
suffix_store_tokens                                      -                      -
request_success_total{finished_reason}                   the same               -
e2e_request_latency_seconds                              the same               -
time_to_first_token_seconds                              the same               -
request_queue_time_seconds                               the same               -
requests_total{endpoint, code}                           -                      -
request_disconnects_total                                -                      -
requests_refused_total{reason}                           -                      -
memory_budget_bytes, memory_reserved_bytes               -                      -
=======================================================  =====================  ======================================

What they count: drafts = decode steps that verified a draft; draft tokens = tokens proposed;
accepted tokens = drafted tokens the target accepted, also by position in the draft (0 = first);
tree drafts = the drafts that were token trees (``--tree``), tree nodes = the draft tokens those trees
held (their drafted tokens count each tree's depth: accepted ÷ drafts is the accepted path's length);
the ``by_source`` counters split drafts, draft tokens and accepted tokens by where each draft came from
(``source``: model, lookup, lookup-short, suffix, suffix-short: specdec.algorithm.control), so acceptance by
source is accepted ÷ draft tokens of one label;
tokens_predicted_seconds = seconds spent generating, prefills included, and predicted_tokens_seconds
the mean tokens/s from it; suffix_store_tokens = the tokens the suffix drafts' store of recent
answers holds now (at most ``--suffix-memory``; 0 without suffix drafts); n_decode = target forward passes, prefills
included; the latencies are
histograms from each request's arrival.

requests_refused_total counts the requests refused before they ran, by reason: memory_budget (a 413: it
needs more than --memory-budget), queue_full (a 503), context_length (a 400: the prompt is over the model's
window or --max-prompt-tokens), body_too_large (a 413), shutting_down (a 503).  memory_budget_bytes is
--memory-budget (0: none), memory_reserved_bytes what the running requests reserve of it now, with what the
runners keep between requests (specdec.runtime.memory.MemoryBudget).

requests_total counts the answers of /v1/completions and /v1/chat/completions by HTTP status; a
client that left before its answer counts as code 499 (nginx's "client closed request").

Generation counters include requests cancelled by a disconnect (their drafts were really drafted);
request_success_total and e2e_request_latency_seconds count the requests that ran to their end,
time_to_first_token_seconds and request_queue_time_seconds every request that got a first token.

Served as Ray Serve replicas (specdec.serve.ray), /metrics is per replica: every replica's series
in one page, each sample labelled ``replica="<Serve's replica id>"`` (:func:`merge_replicas`);
``sum without (replica)`` in PromQL gives the fleet's totals.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

from specdec.algorithm.loop import Stats

PREFIX = "specdec:"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


# the error codes of refusals (specdec.serve.protocol.APIError.code) -> their requests_refused_total reason
REFUSALS = {"memory_budget_exceeded": "memory_budget", "queue_full": "queue_full",
            "context_length_exceeded": "context_length", "body_too_large": "body_too_large",
            "server_shutting_down": "shutting_down"}


class Metrics:
    """The counters, gauges and histograms of one server; `render()` is the /metrics body."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, running: Callable[[], float], waiting: Callable[[], float],
                 store_tokens: Callable[[], float] = lambda: 0.0, budget: Callable[[], float] = lambda: 0.0,
                 reserved: Callable[[], float] = lambda: 0.0) -> None:
        import prometheus_client

        prometheus_client.disable_created_metrics()  # no *_created series: noise on every scrape
        self.registry = registry = CollectorRegistry(auto_describe=True)

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=registry)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(PREFIX + name, doc, buckets=LATENCY_BUCKETS, registry=registry)

        self.drafts = counter("spec_decode_num_drafts", "Decode steps that verified a draft.")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted by the target.")
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted, by position in the draft (0 = first).", ("position",))
        self.tree_drafts = counter("spec_decode_num_tree_drafts", "Drafts that were token trees (counted in drafts).")
        self.tree_nodes = counter("spec_decode_num_tree_nodes", "Draft tokens the token trees held (all verified).")
        self.source_drafts = counter("spec_decode_num_drafts_by_source", "Drafts verified, by draft source.",
                                     ("source",))
        self.source_draft_tokens = counter("spec_decode_num_draft_tokens_by_source", "Draft tokens proposed, by "
                                           "draft source.", ("source",))
        self.source_accepted = counter("spec_decode_num_accepted_tokens_by_source", "Draft tokens accepted, by "
                                       "draft source.", ("source",))
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.decode_seconds = counter("tokens_predicted_seconds", "Seconds spent generating (prefill included).")
        self.forwards = counter("n_decode", "Target forward passes, each prompt's prefill included.")
        self.success = counter("request_success", "Requests that ran to their end, by finish reason.",
                               ("finished_reason",))
        self.requests = counter("requests", "Answers of the completion endpoints, by HTTP status "
                                "(499: the client left first).", ("endpoint", "code"))
        self.disconnects = counter("request_disconnects", "Requests whose client went away before the end.")
        self.refused = counter("requests_refused", "Requests refused before they ran, by reason.", ("reason",))
        for reason in REFUSALS.values():
            self.refused.labels(reason=reason)  # every reason shown from the start, at 0
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token, for requests that finished.")
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.")
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Arrival to the start of generation, for requests that got a first token.")
        Gauge(PREFIX + "num_requests_running", "Requests generating now (0 or 1).",
              registry=registry).set_function(running)
        Gauge(PREFIX + "num_requests_waiting", "Requests queued behind the running one.",
              registry=registry).set_function(waiting)
        Gauge(PREFIX + "suffix_store_tokens", "Tokens the suffix drafts' store of recent answers holds.",
              registry=registry).set_function(store_tokens)
        Gauge(PREFIX + "memory_budget_bytes", "Bytes the running requests' KV caches and activations may take "
              "(--memory-budget; 0: no budget).", registry=registry).set_function(budget)
        Gauge(PREFIX + "memory_reserved_bytes", "Bytes of the memory budget reserved now (running requests, and the "
              "caches kept between requests).", registry=registry).set_function(reserved)
        Gauge(PREFIX + "predicted_tokens_seconds", "Mean generation speed since start, tokens/s.",
              registry=registry).set_function(self._tokens_per_s)

        self._tokens, self._seconds = 0, 0.0  # what the speed gauge divides (written by the worker only)

    def _tokens_per_s(self) -> float:
        return self._tokens / self._seconds if self._seconds > 0 else 0.0

    def record_generation(self, prompt_tokens: int, stats: Stats) -> None:
        """Count one generation's work (finished or cancelled)."""
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(stats.new_tokens)
        self.decode_seconds.inc(stats.wall_s)
        self._tokens, self._seconds = self._tokens + stats.new_tokens, self._seconds + stats.wall_s
        self.forwards.inc(stats.target_forwards)
        self.drafts.inc(stats.draft_steps)
        self.draft_tokens.inc(stats.drafted)
        self.accepted_tokens.inc(stats.accepted)
        self.tree_drafts.inc(stats.tree_steps)
        self.tree_nodes.inc(stats.tree_nodes)
        for position, accepted in enumerate(stats.accepted_at):
            self.accepted_per_pos.labels(position=str(position)).inc(accepted)
        for source, (steps, drafted, accepted) in stats.by_source.items():
            self.source_drafts.labels(source=source).inc(steps)
            self.source_draft_tokens.labels(source=source).inc(drafted)
            self.source_accepted.labels(source=source).inc(accepted)

    def record_refusal(self, code: str | None) -> None:
        """Count a request refused with this error code, where it is a refusal (REFUSALS)."""
        reason = REFUSALS.get(code or "")
        if reason is not None:
            self.refused.labels(reason=reason).inc()

    def record_first_token(self, queued_s: float, first_token_s: float) -> None:
        """A request's first token came `first_token_s` after its arrival, `queued_s` of it in the queue."""
        self.queue_time.observe(queued_s)
        self.ttft.observe(first_token_s)

    def record_finish(self, finish_reason: str, e2e_s: float) -> None:
        """A request ran to its end, `e2e_s` after its arrival."""
        self.success.labels(finished_reason=finish_reason).inc()
        self.e2e.observe(e2e_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def merge_replicas(pages: dict[str, bytes], label: str = "replica") -> bytes:
    """One Prometheus page from several servers' pages: every sample of `pages[name]` gets the label
    ``label="name"``; a metric's HELP and TYPE come once."""
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, Metric] = {}
    for name, page in sorted(pages.items()):
        for family in text_string_to_metric_families(page.decode("utf-8")):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            merged.samples.extend(s._replace(labels={label: name, **s.labels}) for s in family.samples)

    class Pages:  # a collector yielding the merged families
        def collect(self):
            return iter(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Pages())
    return generate_latest(registry)
