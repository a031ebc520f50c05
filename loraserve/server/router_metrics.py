"""Router-ready engine gauges under vLLM's names, so endpoint pickers route to loraserve unchanged.

Kubernetes endpoint pickers (the Gateway API Inference Extension's EPP, llm-d, AIBrix) scrape
each model server's /metrics and pick a pod by queue depth, KV-cache pressure and which LoRA
adapters it is serving. They read vLLM's metric names; this collector exports them from the
engine's published `EngineSnapshot` at scrape time (a few attribute reads: no engine call, no
lock, microseconds):

  vllm:num_requests_running{model_name}   sequences in the running batch
  vllm:num_requests_waiting{model_name}   sequences queued for admission, parked ones (waiting
                                          for their adapter to page in) included
  vllm:kv_cache_usage_perc{model_name}    fraction of KV-cache blocks in use, 0..1
  vllm:gpu_cache_usage_perc{model_name}   the same, under vLLM's older name
  vllm:cache_config_info{block_size, num_gpu_blocks}                     value 1
  vllm:lora_requests_info{running_lora_adapters, waiting_lora_adapters, max_lora}
                                          value: the scrape's wall time (vLLM's convention: a
                                          picker keeps the newest series)
  loraserve_decode_buckets{state}         the decode step's buckets by background-compile state

The adapter lists hold the model names clients sent (`tenant/name`, or `tenant/name@rev` when a
revision was asked for), comma-separated and sorted, so a picker matching a request's `model`
against them finds the pods already serving it.

An engine facade over several engines (the Ray Serve ingress) offers `replica_snapshots()`;
every sample then carries a `replica` label, one series per engine replica.
"""
from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from loraserve.engine.snapshot import EngineSnapshot

REPLICA_LABEL = "replica"

LabelledSnapshot = tuple[dict[str, str], EngineSnapshot]


def labelled_snapshots(engine) -> list[LabelledSnapshot]:
    """(extra labels, snapshot) per engine behind `engine`: one unlabelled snapshot for a single
    engine; one per replica, labelled `replica`, for a facade with `replica_snapshots()`."""
    replicas = engine.replica_snapshots()
    if replicas is None:
        return [({}, engine.snapshot)]
    return [({REPLICA_LABEL: rid}, snap) for rid, snap in sorted(replicas.items())]


def label_names(snaps: list[LabelledSnapshot]) -> list[str]:
    """The extra label names the snapshots carry (the same for all of them)."""
    return list(snaps[0][0]) if snaps else []


class RouterMetricsCollector(Collector):
    """vLLM's router-facing gauges for `engine` (any facade with `snapshot`, `model_name` and
    `config.block_size`)."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        snaps = labelled_snapshots(self.engine)
        extra = label_names(snaps)
        model = self.engine.model_name
        block_size = str(self.engine.config.block_size)
        gauges = [("vllm:num_requests_running", "Number of requests in model execution batches.",
                   lambda s: s.running),
                  ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                   lambda s: s.waiting + s.parked),
                  ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                   lambda s: s.kv_usage),
                  ("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.",
                   lambda s: s.kv_usage)]
        for name, doc, value in gauges:
            m = GaugeMetricFamily(name, doc, labels=[*extra, "model_name"])
            for labels, snap in snaps:
                m.add_metric([*labels.values(), model], value(snap))
            yield m
        cache = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                  labels=[*extra, "block_size", "num_gpu_blocks"])
        lora = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                 labels=[*extra, "running_lora_adapters", "waiting_lora_adapters",
                                         "max_lora"])
        now = time.time()
        for labels, snap in snaps:
            cache.add_metric([*labels.values(), block_size, str(snap.num_kv_blocks)], 1.0)
            lora.add_metric([*labels.values(), ",".join(snap.running_adapters),
                             ",".join(snap.waiting_adapters), str(snap.max_lora)], now)
        yield cache
        yield lora
        yield decode_buckets(snaps)


COMPILE_STATES = ("pending", "compiling", "measuring", "compiled", "eager", "failed")


def decode_buckets(snaps: list[LabelledSnapshot]) -> GaugeMetricFamily:
    """loraserve_decode_buckets{state}: the CPU decode step's buckets by background-compile state
    (engine.core.background_compile); all zero where nothing compiles."""
    m = GaugeMetricFamily("loraserve_decode_buckets", "Decode-step buckets by compile state: "
                          "pending, compiling, measuring, compiled (in use), eager (measured no faster), failed",
                          labels=[*label_names(snaps), "state"])
    for labels, snap in snaps:
        for state in COMPILE_STATES:
            m.add_metric([*labels.values(), state], sum(st == state for _, st in snap.compile))
    return m
