"""vLLM's own Grafana dashboard works on loraserve (issue 43, part 2): every metric name its
PromQL queries, and vLLM's LoRA residency names, are on `loraserve serve`'s /metrics with the
values the engine measured (no constant: each is checked against what the run did).

DASHBOARD_NAMES is every metric name in the `expr` of vLLM's dashboard,
examples/online_serving/prometheus_grafana/grafana.json at vllm-project/vllm commit
004f771f3a6b49597546b05c7d83686d1e121fa0 (the V1 dashboard: an older one, e88892c, also queried
vllm:num_requests_swapped and vllm:cpu_cache_usage_perc, which vLLM V1 dropped). A histogram's
names are its _bucket, _sum and _count series.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serve_process import ADAPTERS, ServeProcess, build_served

DASHBOARD_NAMES = (
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:time_per_output_token_seconds_bucket", "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_count",
    "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:gpu_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum", "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum", "vllm:request_max_num_generation_tokens_sum",
)
LORA_NAMES = (
    "vllm:lora_adapter_load_seconds_bucket", "vllm:lora_adapter_load_seconds_sum",
    "vllm:lora_adapter_load_seconds_count", "vllm:max_gpu_lora_adapters",
    "vllm:num_gpu_loaded_lora_adapters", "vllm:lora_adapter_loaded",
)
MAX_TOKENS = 5


def scrape(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """sample name -> [(labels, value)] of a /metrics page."""
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def total(samples: dict, name: str, **labels: str) -> float:
    return sum(v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[ServeProcess, list[dict]]]:
    """One adapter device slot: a, b, a again (a CPU-tier page-in), c, and the base; greedy,
    MAX_TOKENS tokens each (ignore_eos: every one ends by its length)."""
    base, catalog = build_served(tmp_path_factory.mktemp("dashboard"))
    server = ServeProcess(base, catalog, "--max-gpu-adapters", "1")
    try:
        answers = []
        with httpx.Client(base_url=server.url, timeout=120) as http:
            for model in ("acme/a", "acme/b", "acme/a", "acme/c", "qwen3"):
                r = http.post("/v1/completions", json={
                    "model": model, "prompt": "one two three", "max_tokens": MAX_TOKENS,
                    "temperature": 0, "ignore_eos": True})
                assert r.status_code == 200, r.text
                answers.append(r.json())
        yield server, answers
    finally:
        server.stop()


def test_every_name_vllms_dashboard_queries_is_served_with_measured_values(served) -> None:
    server, answers = served
    m = scrape(server.url)
    missing = [n for n in DASHBOARD_NAMES + LORA_NAMES if n not in m]
    assert not missing, missing
    model = {"model_name": "qwen3"}
    for name in DASHBOARD_NAMES:  # the dashboard filters every query by model_name
        assert all(lab.get("model_name") == "qwen3" for lab, _ in m[name]), name
    requests = len(answers)
    prompt = sum(a["usage"]["prompt_tokens"] for a in answers)
    generated = sum(a["usage"]["completion_tokens"] for a in answers)
    assert generated == requests * MAX_TOKENS
    assert total(m, "vllm:prompt_tokens_total", **model) == prompt
    assert total(m, "vllm:generation_tokens_total", **model) == generated
    for hist in ("e2e_request_latency_seconds", "time_to_first_token_seconds",
                 "time_per_output_token_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds"):
        assert total(m, f"vllm:{hist}_count") == requests, hist
        assert total(m, f"vllm:{hist}_bucket", le="+Inf") == requests, hist
    for hist in ("e2e_request_latency_seconds", "time_to_first_token_seconds",
                 "time_per_output_token_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds"):
        assert total(m, f"vllm:{hist}_sum") > 0, hist  # time passed in each phase
    assert total(m, "vllm:request_prompt_tokens_sum") == prompt
    assert total(m, "vllm:request_generation_tokens_sum") == generated
    assert total(m, "vllm:request_max_num_generation_tokens_sum") == requests * MAX_TOKENS
    assert total(m, "vllm:request_success_total", finished_reason="length") == requests
    assert total(m, "vllm:request_success_total", finished_reason="stop") == 0
    assert total(m, "vllm:num_requests_running") == total(m, "vllm:num_requests_waiting") == 0
    assert 0 <= total(m, "vllm:gpu_cache_usage_perc") <= 1


def test_vllms_lora_names_report_residency_and_load_times(served) -> None:
    server, _ = served
    m = scrape(server.url)
    assert total(m, "vllm:max_gpu_lora_adapters") == 1  # --max-gpu-adapters 1
    assert total(m, "vllm:num_gpu_loaded_lora_adapters") == 1
    loaded = {(lab["adapter_name"], lab["level"]) for lab, v in m["vllm:lora_adapter_loaded"]
              if v == 1}
    assert ("acme/c@r1", "gpu") in loaded  # the last adapter served holds the one slot
    assert {ref + "@r1" for ref in ADAPTERS} <= {name for name, level in loaded if level == "cpu"}
    assert sum(level == "gpu" for _, level in loaded) == 1
    # three page-ins from the catalog; a's second request came from the CPU tier: one
    # activation, timed, as loraserve_adapter_page_in_seconds{source="cpu"} counts it
    assert total(m, "vllm:lora_adapter_load_seconds_count", transition="load") == 3
    assert total(m, "vllm:lora_adapter_load_seconds_count", transition="activation") == \
        total(m, "loraserve_adapter_page_in_seconds_count", source="cpu") == \
        total(m, "loraserve_adapter_hits_total", tier="cpu") >= 1
    assert total(m, "vllm:lora_adapter_load_seconds_sum", transition="load") > 0
    assert total(m, "vllm:lora_adapter_load_seconds_sum", transition="activation") > 0
