"""vLLM's metric names on loraserve's /metrics, so vLLM's own Grafana dashboard works unchanged.

vLLM's dashboard (examples/online_serving/prometheus_grafana/grafana.json) queries these names,
every one with a `model_name` label (the served base's name, as vLLM labels adapters' requests
too); each is mapped to what loraserve measures, never a constant:

  vllm:e2e_request_latency_seconds      = loraserve_e2e_latency_seconds (per HTTP request)
  vllm:time_to_first_token_seconds      = loraserve_ttft_seconds (per HTTP request)
  vllm:prompt_tokens_total              = loraserve_prompt_tokens_total
  vllm:generation_tokens_total          = loraserve_generation_tokens_total
  vllm:request_prompt_tokens            prompt tokens of each finished sequence   (histograms:
  vllm:request_generation_tokens        tokens it generated                        observed when
  vllm:time_per_output_token_seconds    its decode time / (generated tokens - 1)   a sequence's
  vllm:request_queue_time_seconds       engine arrival to first scheduled          last delta
  vllm:request_prefill_time_seconds     first scheduled to first token             arrives:
  vllm:request_decode_time_seconds      first token to the end                     `finished`)
  vllm:request_max_num_generation_tokens  each sequence's max_tokens, at admission
  vllm:request_success_total{finished_reason}  finished sequences: stop | length | abort
  (vllm:num_requests_running/waiting and vllm:gpu_cache_usage_perc are router_metrics.py's)

and vLLM's LoRA residency metrics, from the engine's published snapshot:

  vllm:max_gpu_lora_adapters            device pool slots (--max-gpu-adapters)
  vllm:num_gpu_loaded_lora_adapters     revisions resident in the device pool
  vllm:lora_adapter_loaded{adapter_name, level, pinned}  1 per revision (`tenant/name@rev`)
                                        in the device pool (level "gpu") or the CPU tier ("cpu",
                                        the CPU_RESIDENT_MAX most recently used)
  vllm:lora_adapter_load_seconds{transition}  histogram: "load" = a page-in from the catalog
                                        (disk) into host memory, "activation" = a CPU-tier
                                        revision copied into the device pool (the two sources
                                        of loraserve_adapter_page_in_seconds)

Per-sequence series come from the OpenAI routes (/v1/completions, /v1/chat/completions); the
Tinker SDK's samples count in the token totals, latency and TTFT. Behind a facade over several
engines (Ray Serve) the LoRA series carry a `replica` label.
"""
from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from loraserve.engine.types import RequestOutput
from loraserve.server.router_metrics import label_names, labelled_snapshots

# Fewer buckets than vLLM's (each is a line every scrape renders, ~10-20 us apiece): powers of 8
# for token counts, a few decades for times.
_TOKEN_BUCKETS = (1, 8, 64, 256, 1024, 4096, 16384, 65536)
_TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)
_PHASE_BUCKETS = (0.01, 0.05, 0.25, 1.0, 2.5, 10.0, 40.0, 160.0)
FINISHED_REASONS = ("stop", "length", "abort")
# loraserve_adapter_page_in_seconds{source} -> vllm:lora_adapter_load_seconds{transition}
_TRANSITIONS = {"disk": "load", "cpu": "activation"}


class SequenceMetrics:
    """vLLM's per-sequence histograms, observed by the endpoint, in `registry` under vLLM's
    names, labelled with the served model's name once `bind` has named it (nothing is observed
    before)."""

    def __init__(self, registry=None) -> None:
        self._all: list = []
        self._bound: dict | None = None

        def hist(name: str, doc: str, buckets) -> Histogram:
            h = Histogram(name, doc, ["model_name"], registry=registry, buckets=buckets)
            self._all.append(h)
            return h

        self.prompt = hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                           _TOKEN_BUCKETS)
        self.generation = hist("vllm:request_generation_tokens",
                               "Number of generation tokens processed.", _TOKEN_BUCKETS)
        self.max_tokens = hist("vllm:request_max_num_generation_tokens",
                               "Histogram of maximum number of requested generation tokens.",
                               _TOKEN_BUCKETS)
        self.tpot = hist("vllm:time_per_output_token_seconds",
                         "Histogram of time per output token in seconds.", _TPOT_BUCKETS)
        self.queue = hist("vllm:request_queue_time_seconds",
                          "Histogram of time spent in WAITING phase for request.", _PHASE_BUCKETS)
        self.prefill = hist("vllm:request_prefill_time_seconds",
                            "Histogram of time spent in PREFILL phase for request.", _PHASE_BUCKETS)
        self.decode = hist("vllm:request_decode_time_seconds",
                           "Histogram of time spent in DECODE phase for request.", _PHASE_BUCKETS)
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               ["model_name", "finished_reason"], registry=registry)

    def bind(self, model_name: str) -> None:
        """Label every series with `model_name` (the served base's) from now on."""
        b = {name: h.labels(model_name=model_name) for name, h in vars(self).items()
             if h in self._all}
        b["success"] = {r: self.success.labels(model_name=model_name, finished_reason=r)
                        for r in FINISHED_REASONS}
        self._bound = b

    def admitted(self, max_tokens: int, sequences: int) -> None:
        """`sequences` sequences, each allowed `max_tokens`, entered the engine."""
        if self._bound is not None:
            for _ in range(sequences):
                self._bound["max_tokens"].observe(max_tokens)

    def finished(self, out: RequestOutput) -> None:
        """A sequence's last delta (`out.finish_reason` set): its tokens and, with the engine's
        `timings`, its phases. An error is no success and has no phases."""
        b = self._bound
        if b is None or out.finish_reason not in FINISHED_REASONS:
            return
        b["success"][out.finish_reason].inc()
        b["prompt"].observe(out.num_prompt_tokens)
        b["generation"].observe(out.num_output_tokens)
        if out.timings is None:
            return
        queue_s, prefill_s, decode_s = out.timings
        b["queue"].observe(queue_s)
        b["prefill"].observe(prefill_s)
        b["decode"].observe(decode_s)
        if out.num_output_tokens > 1:
            b["tpot"].observe(decode_s / (out.num_output_tokens - 1))


def renamed(families, name: str, labels: dict[str, str]) -> Metric:
    """The samples of `families` (one metric's collect()) as metric `name` with `labels` added;
    `_created` samples are left out (a scrape's wall time, not a measurement)."""
    family = next(iter(families))
    m = Metric(name, family.documentation, family.type)
    for s in family.samples:
        if s.name.endswith("_created"):
            continue
        m.add_sample(name + s.name[len(family.name):], {**labels, **s.labels}, s.value)
    return m


class VllmCollector(Collector):
    """The vLLM names of the module doc that are another series renamed, or the snapshot's, for
    `engine` (its `model_name`, snapshots) and `metrics` (the app's ServerMetrics, whose
    SequenceMetrics it binds to the model's name; those are in its registry already)."""

    def __init__(self, engine, metrics) -> None:
        self.engine = engine
        self.metrics = metrics
        metrics.sequences.bind(engine.model_name)

    def collect(self) -> Iterator[Metric]:
        model = {"model_name": self.engine.model_name}
        m = self.metrics
        yield renamed(m.e2e_latency.collect(), "vllm:e2e_request_latency_seconds", model)
        yield renamed(m.ttft.collect(), "vllm:time_to_first_token_seconds", model)
        yield renamed(m.prompt_tokens.collect(), "vllm:prompt_tokens", model)
        yield renamed(m.generation_tokens.collect(), "vllm:generation_tokens", model)
        if self.engine.snapshot is not None:  # an engine that publishes one (not a test fake)
            yield from lora_families(labelled_snapshots(self.engine), model)


def lora_families(snaps, model: dict[str, str]) -> Iterator[Metric]:
    """vLLM's LoRA residency gauges and load-time histogram from the engines' snapshots."""
    snaps = [(labels, s) for labels, s in snaps if s.pool is not None]  # no catalog: no adapters
    extra = [*label_names(snaps), *model]
    slots = GaugeMetricFamily("vllm:max_gpu_lora_adapters",
                              "Maximum number of LoRA adapters resident on the GPU.", labels=extra)
    resident = GaugeMetricFamily("vllm:num_gpu_loaded_lora_adapters",
                                 "Number of LoRA adapters loaded on the GPU.", labels=extra)
    loaded = GaugeMetricFamily("vllm:lora_adapter_loaded",
                               "1 for each LoRA adapter loaded, by level (gpu, cpu)",
                               labels=[*extra, "adapter_name", "level", "pinned"])
    load = Metric("vllm:lora_adapter_load_seconds", "Time to make a LoRA adapter servable, by "
                  "transition: load (catalog to host memory), activation (host to device)",
                  "histogram")
    for labels, snap in snaps:
        values = [*labels.values(), *model.values()]
        slots.add_metric(values, snap.max_lora)
        resident.add_metric(values, snap.pool.resident_adapters)
        pinned = {tuple(k) for k in snap.pinned}
        for level, keys in (("gpu", sorted(snap.resident)), ("cpu", snap.cpu_resident)):
            for aid, rev in keys:
                loaded.add_metric([*values, f"{aid}@{rev}", level,
                                   str((aid, rev) in pinned and level == "gpu").lower()], 1.0)
        for name, sample_labels, value in snap.page_in_samples:
            sample_labels = dict(sample_labels)
            transition = _TRANSITIONS.get(sample_labels.pop("source", ""))
            if transition is None or name.endswith("_created"):
                continue
            suffix = name[len("loraserve_adapter_page_in_seconds"):]
            load.add_sample("vllm:lora_adapter_load_seconds" + suffix,
                            {**labels, **model, **sample_labels, "transition": transition}, value)
    yield slots
    yield resident
    yield loaded
    yield load
