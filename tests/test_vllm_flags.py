"""vLLM's habits: its `serve` flag names as aliases of ours (one option each), --enable-lora
accepted, --lora-modules imported at start-up and served by their names, --api-key a bearer key,
and names without a tenant belonging to the default tenant."""
from __future__ import annotations

import argparse
import logging
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loraserve.catalog.ids import DEFAULT_TENANT, with_default_tenant
from loraserve.catalog.store import Catalog
from loraserve.cli import VLLM_ALIASES, build_parser
from loraserve.engine.config import EngineConfig
from loraserve.server import build_app
from loraserve.server.lora_modules import LoraModule, import_lora_modules, parse_lora_module

from lora.conftest import make_peft
from server.fake_engine import FakeEngine
from server.live import LiveServer


def _serve_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_vllm_names_set_our_options() -> None:
    args = _serve_args("--max-loras", "3", "--max-cpu-loras", "5", "--max-num-seqs", "7",
                       "--max-num-batched-tokens", "99", "--enable-lora")
    assert (args.max_gpu_adapters, args.max_cpu_adapters, args.max_batch_size,
            args.max_batched_tokens) == (3, 5, 7, 99)
    ours = _serve_args("--max-gpu-adapters", "3", "--max-batch-size", "7")
    assert (ours.max_gpu_adapters, ours.max_batch_size) == (3, 7)
    assert _serve_args().max_cpu_adapters is None  # only the byte bound unless asked


def test_each_alias_is_the_same_option_in_help() -> None:
    serve = next(a for a in build_parser()._subparsers._group_actions[0].choices.items()
                 if a[0] == "serve")[1]
    by_dest = {a.dest: a.option_strings for a in serve._actions}
    for field, alias in VLLM_ALIASES.items():
        assert alias in by_dest[field], field  # an alias, not a second option
        assert sum(alias in strings for strings in by_dest.values()) == 1
    text = " ".join(serve.format_help().split())
    assert "LoRA is always on" in text and "--lora-modules" in text


def test_a_cpu_count_bound_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="max_cpu_adapters"):
        EngineConfig(model_dir="m", max_cpu_adapters=0)


def test_lora_modules_forms() -> None:
    assert parse_lora_module("sql-lora=/p") == LoraModule("default/sql-lora", "/p")
    assert parse_lora_module("acme/x=/p") == LoraModule("acme/x", "/p")
    assert parse_lora_module('{"name": "j", "path": "/q", "base_model_name": "qwen3"}') == \
        LoraModule("default/j", "/q", "qwen3")
    for bad in ("no-equals", "=/p", '{"name": "j"}', '{"name": "j", "path": "/q", "x": 1}',
                "bad name=/p"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_lora_module(bad)
    args = _serve_args("--lora-modules", "a=/1", "b=/2", "--lora-modules", "c=/3")
    assert [m.adapter_id for m in args.lora_modules] == ["default/a", "default/b", "default/c"]


def test_default_tenant_names() -> None:
    assert DEFAULT_TENANT == "default"
    assert with_default_tenant("sql-lora@r2") == "default/sql-lora@r2"
    assert with_default_tenant("acme/x@r2") == "acme/x@r2"


def test_lora_modules_need_a_catalog_and_the_served_base(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--catalog"):
        import_lora_modules([LoraModule("default/a", str(tmp_path))], None, "m", "qwen3")
    with pytest.raises(ValueError, match="base_model_name"):
        import_lora_modules([LoraModule("default/a", str(tmp_path), "llama")], "c", "m", "qwen3")
    with pytest.raises(ValueError, match="not a directory"):
        import_lora_modules([LoraModule("default/a", str(tmp_path / "none"))], "c", "m", "qwen3")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, hf_dense: Path) -> Iterator[str]:
    """A real engine over a catalog that --lora-modules filled (twice: the same revision), with
    a CPU tier bounded by --max-cpu-loras and runtime loading from an adapter root."""
    from loraserve.engine.async_engine import AsyncEngine

    root = tmp_path_factory.mktemp("vllm_flags")
    peft = make_peft(hf_dense, root / "peft_root" / "qv", seed=3, r=4, lora_alpha=8,
                     target_modules=["q_proj", "v_proj"])
    Catalog.create(root / "catalog", shards=4).close()
    modules = [parse_lora_module(f"sql-lora={peft}")]
    first = import_lora_modules(modules, str(root / "catalog"), str(hf_dense), "qwen3")
    again = import_lora_modules(modules, str(root / "catalog"), str(hf_dense), "qwen3")
    assert first == again == ["default/sql-lora@r1"]  # a restart with the same flags: no new revision
    args = _serve_args("--max-cpu-loras", "2", "--max-loras", "2")
    engine = AsyncEngine.from_model_dir(
        str(hf_dense), catalog_dir=str(root / "catalog"), device="cpu", dtype="float32",
        max_model_len=64, max_batch_size=4, max_lora_rank=8, adapter_root=str(root / "peft_root"),
        max_gpu_adapters=args.max_gpu_adapters, max_cpu_adapters=args.max_cpu_adapters)
    assert engine.transport.engine.adapters.cpu_cache.max_entries == 2
    with LiveServer(build_app(engine, api_key="vllm-key")) as live:
        yield live.url
    shutil.rmtree(root, ignore_errors=True)


def _access_lines(caplog: pytest.LogCaptureFixture, count: int) -> list[dict]:
    """The request lines, once `count` are written (each goes out as its response ends)."""
    deadline = time.monotonic() + 30
    while True:
        lines = [r.request for r in caplog.records if r.name == "loraserve.server.access"]
        if len(lines) >= count or time.monotonic() > deadline:
            return lines
        time.sleep(0.01)


def _cpu_hits(c: httpx.Client) -> float:
    text = c.get("/metrics").text
    [line] = [line for line in text.splitlines()
              if line.startswith('loraserve_adapter_hits_total{tier="cpu"}')]
    return float(line.rsplit(" ", 1)[1])


def test_vllm_names_are_served(served: str, caplog: pytest.LogCaptureFixture) -> None:
    """...and each request's log line says where its adapter came from: a cold one from the
    catalog, then from the device pool; one /v1/load_lora_adapter put in the CPU tier from it."""
    caplog.set_level(logging.INFO, logger="loraserve.server.access")
    auth = {"Authorization": "Bearer vllm-key"}
    with httpx.Client(base_url=served, timeout=120, headers=auth) as c:
        body = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
        bare = c.post("/v1/completions", json={"model": "sql-lora", **body})
        full = c.post("/v1/completions", json={"model": "default/sql-lora", **body})
        assert bare.status_code == full.status_code == 200, bare.text
        assert bare.json()["choices"][0]["text"] == full.json()["choices"][0]["text"]
        loaded = c.post("/v1/load_lora_adapter", json={"lora_name": "fresh", "lora_path": "qv"})
        assert loaded.status_code == 200, loaded.text
        assert loaded.json()["id"] == "default/fresh"
        hits = _cpu_hits(c)
        assert c.post("/v1/completions", json={"model": "fresh", **body}).status_code == 200
        deadline = time.monotonic() + 30  # /metrics reads the engine's published snapshot
        while _cpu_hits(c) == hits and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _cpu_hits(c) == hits + 1  # the CPU tier served it, and the hit counter says so
        lines = [line for line in _access_lines(caplog, 4) if line["path"] == "/v1/completions"]
        assert [(line["model"], line["adapter"], line["tier"]) for line in lines] == [
            ("sql-lora", "default/sql-lora@r1", "catalog"),
            ("default/sql-lora", "default/sql-lora@r1", "device"),
            ("fresh", "default/fresh@r1", "cpu")]
        # /v1/models/{id} answers every name completions serve (the same resolver)
        for name in ("sql-lora", "default/sql-lora", "sql-lora@r1", "fresh"):
            card = c.get(f"/v1/models/{name}")
            assert card.status_code == 200 and card.json()["id"] == name, card.text
        assert c.get("/v1/models/nothing-here").status_code == 404
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "fresh"}).status_code == 200
        missing = c.post("/v1/completions", json={"model": "nothing-here", **body})
        assert missing.status_code == 404
        assert missing.json()["error"]["message"] == "The model `nothing-here` does not exist."


def test_api_key_is_a_bearer_key() -> None:
    args = _serve_args("--api-key", "vllm-key")
    with LiveServer(build_app(FakeEngine(), api_key=args.api_key)) as live, \
            httpx.Client(base_url=live.url, timeout=30) as c:
        body = {"model": "fake-base", "prompt": "x", "max_tokens": 1}
        assert c.post("/v1/completions", json=body).status_code == 401
        ok = c.post("/v1/completions", json=body, headers={"Authorization": "Bearer vllm-key"})
        assert ok.status_code == 200


# -- issue 43: `vllm serve MODEL`, --gpu-memory-utilization, tool-call flags ----------------------

def test_the_model_as_vllm_gives_it(tmp_path: Path) -> None:
    from loraserve.cli import _model_arg
    from loraserve.cli_config import reparse

    assert _model_arg(_serve_args("/m")) == "/m"
    assert _model_arg(_serve_args("--model", "/m")) == "/m"
    assert _model_arg(_serve_args("/m", "--model", "/m", "--port", "1")) == "/m"
    with pytest.raises(ValueError, match="given twice"):
        _model_arg(_serve_args("/m", "--model", "/n"))
    # settings from the environment (a flag of several values among them) leave MODEL alone
    args = reparse(build_parser(), ["serve", "/m"], "serve",
                   environ={"LORASERVE_LORA_MODULES": "a=/p", "LORASERVE_PORT": "9"})
    assert (_model_arg(args), args.port, [m.adapter_id for m in args.lora_modules]) == (
        "/m", 9, ["default/a"])


def test_gpu_memory_utilization(hf_dense: Path, capsys: pytest.CaptureFixture) -> None:
    from loraserve.cli import main
    from loraserve.cli_gpu import GIB, MIB, apply, kv_cache_mb

    assert _serve_args("--gpu-memory-utilization", "0.9").gpu_memory_utilization == 0.9
    for bad in ("0", "1.5", "most"):
        with pytest.raises(SystemExit):
            _serve_args("--gpu-memory-utilization", bad)
    # on CUDA: the share, less the weights, the adapter pool and the reserve, is the KV cache
    options = {"device": "cuda", "dtype": "float16", "gpu_adapter_mb": 64,
               "max_batched_tokens": 256, "max_batch_size": 4}
    mb = kv_cache_mb(0.5, options, str(hf_dense), memory=(70 * GIB, 80 * GIB))
    assert 40 * 1024 - 64 - 1024 - 8 < mb < 40 * 1024 - 64 - 1024
    assert kv_cache_mb(0.9, options, str(hf_dense), memory=(80 * GIB, 80 * GIB)) > mb
    with pytest.raises(ValueError, match="only 10.0 GiB are free"):
        kv_cache_mb(0.5, options, str(hf_dense), memory=(10 * GIB, 80 * GIB))
    with pytest.raises(ValueError, match="no room for the KV cache"):
        kv_cache_mb(0.5, options, str(hf_dense), memory=(GIB, GIB))
    args = _serve_args("--gpu-memory-utilization", "0.5")
    with pytest.raises(ValueError, match="both size the KV cache"):
        apply(args, {**options, "kv_cache_mb": 100}, str(hf_dense))
    # on the CPU: refused, naming the flag that sizes the cache there (one line, exit 1)
    capsys.readouterr()
    assert main(["serve", str(hf_dense), "--device", "cpu", "--gpu-memory-utilization", "0.9"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--kv-cache-mb" in err and "on the CPU" in err
    assert MIB == 2**20


def test_tool_call_flags(capsys: pytest.CaptureFixture) -> None:
    from loraserve.server.config import ServerConfig
    from loraserve.server.tool_calls import LLAMA3, MISTRAL, QWEN, plan_tools

    args = _serve_args("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    assert args.enable_auto_tool_choice and args.tool_call_parser == "hermes"
    with pytest.raises(SystemExit):
        _serve_args("--tool-call-parser", "pythonic")
    err = capsys.readouterr().err
    assert "'pythonic' is not one loraserve parses" in err and "hermes, llama3_json, mistral" in err
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral"):
        ServerConfig(tool_call_parser="granite")
    # the named format parses a template that renders tools, instead of the one its markers say
    tools = [{"type": "function", "function": {"name": "f"}}]
    qwen_template = "{% if tools %}<tool_call>{% endif %}"
    assert plan_tools(tools, "auto", None, qwen_template).family is QWEN
    assert plan_tools(tools, "auto", None, qwen_template, MISTRAL).family is MISTRAL
    assert plan_tools(tools, "auto", None, "{{ tools }}", LLAMA3).family is LLAMA3


# a template that renders tools but writes no tool-call marker loraserve knows: only
# --tool-call-parser says how to read its calls
UNMARKED_TOOLS = ("{% if tools %}<|im_start|>system\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
                  "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                  "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                  "{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
    "required": ["city"], "additionalProperties": False}}}


def test_a_vllm_tool_calling_command_line_serves_parsed_calls(tmp_path: Path) -> None:
    """`serve BASE --enable-auto-tool-choice --tool-call-parser hermes`, as vLLM is started:
    `auto` is taken on a template with no markers of its own (refused without the flag), and a
    named or required call comes back parsed as tool_calls, in the hermes format."""
    import json

    from loraserve.demo import build_demo_base
    from loraserve.server.errors import APIError
    from loraserve.server.tool_calls import plan_tools
    from serve_process import ServeProcess

    base = build_demo_base(tmp_path / "qwen3")
    config = json.loads((base / "tokenizer_config.json").read_text())
    config["chat_template"] = UNMARKED_TOOLS
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(APIError, match="tool_choice \"auto\" is not supported"):
        plan_tools([WEATHER], "auto", None, UNMARKED_TOOLS)  # what the flag changes
    server = ServeProcess(base, None, "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                          "--max-model-len", "1024", positional=True)
    try:
        with httpx.Client(base_url=server.url, timeout=300) as http:
            ask = {"model": "qwen3", "messages": [{"role": "user", "content": "Weather in Oslo?"}],
                   "tools": [WEATHER], "max_tokens": 400, "temperature": 0}
            auto = http.post("/v1/chat/completions", json={**ask, "tool_choice": "auto"})
            assert auto.status_code == 200, auto.text
            for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
                r = http.post("/v1/chat/completions", json={**ask, "tool_choice": choice})
                assert r.status_code == 200, r.text
                answer = r.json()["choices"][0]
                assert answer["finish_reason"] == "tool_calls", answer
                [call] = answer["message"]["tool_calls"]
                assert call["type"] == "function" and call["function"]["name"] == "get_weather"
                assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Oslo")
                assert "<tool_call>" not in (answer["message"]["content"] or "")
    finally:
        rc = server.stop()
    assert rc in (0, 130), server.output()  # 130: ended by SIGINT, as a shell reports Ctrl-C


# --- vLLM flags without an option of that name (loraserve/cli_vllm.py) ---

from loraserve.cli_vllm import INSTEAD, PARALLEL  # noqa: E402


def test_vllm_flags_that_ask_for_what_we_do_start_the_server(serve_config, tmp_path) -> None:
    from loraserve.demo import build_demo_base
    base = str(build_demo_base(tmp_path / "base"))
    cfg = serve_config([base, "--enforce-eager", "--no-enable-prefix-caching", "--trust-remote-code",
                        "--enable-chunked-prefill", "--tensor-parallel-size", "1", "-pp", "1", "-dp", "1",
                        "--enable-lora", "--max-loras", "3"])
    assert (cfg.compile, cfg.prefix_caching, cfg.max_gpu_adapters) == ("off", False, 3)
    cfg = serve_config([base, "--enable-prefix-caching"])
    assert (cfg.compile, cfg.prefix_caching) == ("auto", True)


@pytest.mark.parametrize("flag", sorted(INSTEAD))
def test_each_vllm_flag_we_lack_is_refused_in_one_line_naming_ours(flag, capsys) -> None:
    argv = [flag] + (["x"] if INSTEAD[flag][0] else [])
    with pytest.raises(SystemExit) as stop:
        _serve_args(*argv)
    assert stop.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("loraserve serve: error: " + flag) and INSTEAD[flag][1] in last


@pytest.mark.parametrize("flag", sorted(PARALLEL))
def test_parallel_sizes_other_than_one_name_replicas(flag, capsys) -> None:
    assert getattr(_serve_args(flag, "1"), flag.strip("-").replace("-", "_")) == 1
    with pytest.raises(SystemExit):
        _serve_args(flag, "2")
    assert "--replicas" in capsys.readouterr().err
