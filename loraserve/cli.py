"""`loraserve` command line: serve, demo, export, catalog ..., loadtest, keys."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from dataclasses import MISSING, Field
from pathlib import Path
from types import UnionType
from typing import Any, Union, get_args, get_origin, get_type_hints

from loraserve.catalog.dtypes import SERVING_DTYPES

from .engine.config import EngineConfig

DEFAULT_DEMO_DIR = ".loraserve/demo"

# vLLM's names for `serve` options, accepted as aliases of ours (one option each, one table):
# EngineConfig field -> the vLLM flag that sets it
VLLM_ALIASES = {
    "max_gpu_adapters": "--max-loras",
    "max_cpu_adapters": "--max-cpu-loras",
    "max_batch_size": "--max-num-seqs",
    "max_batched_tokens": "--max-num-batched-tokens",
}


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve the OpenAI-compatible API")
    p.add_argument("model_arg", nargs="?", metavar="MODEL",
                   help="the base model, as --model (vLLM's `vllm serve MODEL`)")
    p.add_argument("--model", help="base model directory (HF layout) or a .gguf file (converted once, "
                                   "into $LORASERVE_CACHE or ~/.cache/loraserve); default: the SmolLM2 demo "
                                   "(SmolLM2-135M-Instruct GGUF from $LORASERVE_SMOLLM2 or `make models`)")
    p.add_argument("--catalog", help="adapter catalog directory; default: the SmolLM2 demo catalog "
                                     "(demo/french, demo/json, demo/pirate) under --demo-dir")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    _add_engine_options(p)
    p.add_argument("--api-key", default=os.environ.get("LORASERVE_API_KEY"),
                   help="one admin key, sent as 'Authorization: Bearer KEY' (vLLM's --api-key) "
                        "(default: $LORASERVE_API_KEY)")
    p.add_argument("--enable-lora", action="store_true",
                   help="accepted for vLLM command lines and does nothing: LoRA is always on")
    from .cli_gpu import check_fraction
    p.add_argument("--gpu-memory-utilization", type=check_fraction, metavar="F",
                   help="vLLM's: size the KV cache so that the server uses this share of the "
                        "GPU's memory (weights, adapter pool and a reserve included); on CUDA "
                        "only, instead of --kv-cache-mb (default: --kv-cache-mb's)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM command lines and does nothing: tool calls are always "
                        "parsed (tool_choice \"auto\")")
    from .server.tool_calls import PARSERS
    p.add_argument("--tool-call-parser", metavar="NAME", type=_tool_call_parser,
                   help=f"vLLM's: the tool-call format the model writes, one of "
                        f"{', '.join(PARSERS)} (default: read off the chat template's markers)")
    from .cli_vllm import add_vllm_flags
    add_vllm_flags(p)
    from .server.lora_modules import parse_lora_module
    p.add_argument("--lora-modules", nargs="+", action="extend", type=parse_lora_module,
                   default=[], metavar="NAME=PATH",
                   help="PEFT directories imported into --catalog at start-up and served as NAME "
                        "(a NAME without a tenant is the default tenant's: default/NAME); also "
                        "vLLM's JSON form '{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'")
    p.add_argument("--keys", metavar="FILE", help="API keys file (TOML: hashed keys, roles, tenants, "
                   "limits; see `loraserve keys create`); re-read on SIGHUP")
    p.add_argument("--metrics-key", default=os.environ.get("LORASERVE_METRICS_KEY"),
                   help="a key that may read /metrics only (default: $LORASERVE_METRICS_KEY)")
    p.add_argument("--audit-log", metavar="FILE", help="append control-plane actions here (JSON lines)")
    p.add_argument("--demo-dir", default=DEFAULT_DEMO_DIR)
    p.add_argument("--single-process", action="store_true",
                   help="run the engine on a thread of the API server's process (debugging) instead "
                        "of in its own engine-core process")
    p.add_argument("--engine-timeout", type=_positive_seconds, default=30.0, metavar="S",
                   help="a stalled engine core (no heartbeat, or its loop stuck in one step): "
                        "/ready answers 503 within seconds, the requests in flight end with a 503 "
                        "after S seconds without progress, and the core is killed and replaced "
                        "(restarts back off from 0.5 s to 30 s) (default: 30)")
    p.add_argument("--engine-start-timeout", type=_positive_seconds, default=None, metavar="S",
                   help="a new engine core not ready after S seconds (loading the base, compiling "
                        "its decode step) is killed and replaced (default: 300, or 1800 with "
                        "--compile on|auto, where compiling can take minutes)")
    p.add_argument("--log-level", default="info")
    p.add_argument("--config", metavar="FILE",
                   help="a TOML file of these flags, flag names as keys (e.g. max-batch-size = 32); "
                        "$LORASERVE_<FLAG> variables override it, flags override both")
    p.add_argument("--log-format", choices=["text", "json"], default="text",
                   help="text lines, or one JSON object per line (each request's line with its "
                        "fields at the top level) (default: text)")
    from .server.connections import add_arguments as add_connection_bounds
    add_connection_bounds(p)
    from .ray_serve.config import add_arguments as add_scale_out  # no Ray import
    add_scale_out(p)
    p.set_defaults(func=_serve)


def _tool_call_parser(name: str) -> str:
    """argparse type of --tool-call-parser: a name loraserve parses (the error lists them)."""
    from .server.tool_calls import check_parser
    try:
        check_parser(name)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--tool-call-parser ")) from None
    return name


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text}")
    return value


def _add_engine_options(p: argparse.ArgumentParser) -> None:
    """The `serve` options that set an EngineConfig field; default, type and help come from it."""
    def option(name: str, **kwargs: Any) -> None:
        _add_config_option(p, name, alias=VLLM_ALIASES.get(name), **kwargs)

    option("device", choices=["auto", "cpu", "cuda"])
    option("dtype", choices=["auto", *SERVING_DTYPES])
    option("max_gpu_adapters")
    option("gpu_adapter_mb")
    option("max_lora_rank")
    option("cpu_cache_mb")
    option("max_cpu_adapters")
    option("max_batch_size")
    option("max_waiting")
    option("max_model_len")
    option("kv_cache_mb")
    option("max_batched_tokens")
    option("grammar_compile_timeout_s", metavar="S")
    option("train_max_tokens")
    option("train_state_dir", metavar="DIR")
    option("prefix_caching", flag="--no-prefix-caching")
    option("served_model_name")
    option("tokenizer_name")
    option("lora_backend", choices=["auto", "triton", "torch"])
    option("pinned_adapters", flag="--pin", metavar="ID", help="keep this adapter resident (repeatable)")
    option("adapter_root")
    option("max_adapter_mb")
    option("adapter_sources", flag="--adapter-source", metavar="URI")
    option("source_deadline_s", metavar="S")
    option("catalog_store", metavar="s3://BUCKET/PREFIX")
    option("pager_workers")
    option("pager_batch")
    option("compile", choices=["auto", "on", "off"])
    p.add_argument("--no-compile", dest="compile", action="store_const", const="off",
                   help="run the decode step eagerly (the same as --compile off)")
    option("compile_batch_sizes", flag="--compile-batch-size", metavar="N")
    option("weight_prepack", choices=["auto", "on", "off"])
    option("quantize", choices=["auto", "none", "int8", "int4"])
    p.add_argument("--dequantize", dest="quantize", action="store_const", const="none",
                   help="serve a quantized GGUF file's weights dequantized (the same as --quantize none)")
    option("quantize_group", choices=[32, 64, 128], metavar="32|64|128")
    option("allow_quantized_base_adapters")
    option("torch_threads")
    option("max_request_bytes")  # ServerConfig's, below: the HTTP side's
    option("max_seqs_per_request")
    option("shutdown_timeout")


def _add_config_option(p: argparse.ArgumentParser, name: str, *, flag: str | None = None,
                       help: str | None = None, alias: str | None = None, **kwargs: Any) -> None:
    """An option setting the EngineConfig or ServerConfig field `name`, its dest the field's name.

    The flag is `--field-name` unless given. Type and action follow the field's type (int, str;
    bool: a switch away from the default; list: repeatable). The default is the field's; the help
    is `help` or the field's `metadata["help"]`, then "(default: X)", X the field's
    `metadata["default"]` (how an unset value reads) or else its default value. Other keywords
    go to `add_argument` (e.g. `choices`). `alias` is a second name of the same option (vLLM's).
    """
    cls = next(c for c in _configs() if name in c.__dataclass_fields__)
    f = cls.__dataclass_fields__[name]
    default = f.default_factory() if f.default is MISSING else f.default  # type: ignore[misc]
    hint = get_type_hints(cls)[name]
    flags = [flag or "--" + name.replace("_", "-"), *([alias] if alias else [])]
    p.add_argument(*flags, dest=name, default=default, help=_help(f, default, help),
                   **_action(hint, default), **kwargs)


def _configs() -> tuple[type, type]:
    """The two configurations `serve`'s generated options set: the engine's and the server's."""
    from .server.config import ServerConfig
    return EngineConfig, ServerConfig


def _server_config(args: argparse.Namespace):
    """The ServerConfig of `serve`'s flags."""
    from .server.config import ServerConfig
    return ServerConfig(api_key=args.api_key or None, keys=args.keys, metrics_key=args.metrics_key,
                        audit_log=args.audit_log, max_request_bytes=args.max_request_bytes,
                        max_seqs_per_request=args.max_seqs_per_request,
                        shutdown_timeout=args.shutdown_timeout,
                        tool_call_parser=args.tool_call_parser)


def _action(hint: Any, default: Any) -> dict[str, Any]:
    """argparse `type`/`action` for a field typed `hint` (`X | None` reads as X)."""
    args = [a for a in get_args(hint) if a is not type(None)]
    if get_origin(hint) in (UnionType, Union) and len(args) == 1:
        hint = args[0]
    if hint is bool:
        return {"action": "store_false" if default else "store_true"}
    if get_origin(hint) is list:
        return {"action": "append", "type": get_args(hint)[0]}
    return {"type": hint}


def _help(f: Field, default: Any, text: str | None) -> str:
    """`text` (else the field's help) and the default; a switch says what it turns off/on."""
    text = text or f.metadata.get("help", "")
    if isinstance(default, bool):
        text, shown = f"{'turn off' if default else 'turn on'}: {text}", "on" if default else "off"
    else:
        shown = f.metadata.get("default", default)
    return f"{text} (default: {shown})".replace("%", "%%")


def _serve(args: argparse.Namespace) -> int:
    from .engine.async_engine import AsyncEngine
    from .engine.client.core_client import CoreClient
    from .server.app import run_server

    from .server.request_log import configure_logging
    configure_logging(args.log_level, args.log_format)
    from .logs import LOG_FORMAT_ENV, ship_stdio_as_json
    os.environ[LOG_FORMAT_ENV] = args.log_format  # the engine core and shard hosts log alike
    if args.log_format == "json":  # and every stray line (a child's, a C library's) is wrapped
        ship_stdio_as_json()
    from .ray_serve.config import from_args as scale_out
    scale = scale_out(args)  # None: one engine; bad --replicas values stop here
    from .server.connections import from_args as connection_bounds, plan_connections
    connections = connection_bounds(args)  # bad values, or a cap over RLIMIT_NOFILE, stop here
    if scale is None:
        plan_connections(connections)
    elif connections != type(connections)():
        logging.getLogger("loraserve").warning(
            "the connection-bound flags do not apply with --replicas: Ray Serve's proxy answers "
            "HTTP (see docs/OPERATIONS.md, Connection bounds)")
    if args.keys:
        from .keys import load_keys
        load_keys(args.keys)  # a bad keys file stops here, before the model loads
    server_config = _server_config(args)
    model, catalog = _model_arg(args), args.catalog
    options = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)
               if hasattr(args, f.name)}  # the dests of _add_engine_options
    if model is None:  # the SmolLM2 demo: its GGUF must be there (`make models`), no other base
        from .demo import build_smollm2_demo
        demo = build_smollm2_demo(Path(args.demo_dir), progress=logging.getLogger("loraserve").info)
        model, catalog = str(demo.base), catalog or str(demo.catalog)
        if options.get("served_model_name") is None:
            options["served_model_name"] = demo.served_name  # as `serve --model FILE.gguf` names it
    else:
        model = _resolve_model(model, options)
    from .cli_gpu import apply as apply_gpu_share
    apply_gpu_share(args, options, model)  # --gpu-memory-utilization -> kv_cache_mb
    cfg = EngineConfig(model_dir=model, catalog_dir=catalog, **options)
    from .server.lora_modules import import_lora_modules
    for ref in import_lora_modules(args.lora_modules, catalog, model, cfg.model_name):
        logging.getLogger("loraserve").info("--lora-modules: serving %s", ref)
    if scale is not None:  # Ray Serve: N engine replicas behind the same app
        from .ray_serve.launch import run
        run(cfg, scale, server_config)
        return 0
    engine = (AsyncEngine.from_config(cfg) if args.single_process
              else CoreClient(cfg, engine_timeout_s=args.engine_timeout,
                              start_timeout_s=args.engine_start_timeout))
    run_server(engine, server_config, host=args.host, port=args.port,
               log_level=args.log_level.lower(), connections=connections, log_format=args.log_format)
    return 0


def _model_arg(args: argparse.Namespace) -> str | None:
    """The base model: `serve MODEL` (vLLM's form) or --model; both, naming two, is an error."""
    positional = getattr(args, "model_arg", None)
    if positional is not None and args.model is not None and positional != args.model:
        raise ValueError(f"the model is given twice: {positional!r} and --model {args.model!r}")
    return positional if positional is not None else args.model


def _resolve_model(model: str, options: dict[str, Any]) -> str:
    """The base directory `serve` runs: `model` itself, or a GGUF file's converted directory
    (model/gguf.py), whose served name then defaults to the file's stem."""
    from .model.gguf import is_gguf_file, resolve_base
    if is_gguf_file(model) and options.get("served_model_name") is None:
        options["served_model_name"] = Path(model).stem
    return str(resolve_base(model))


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="build the SmolLM2 demo catalog (the shipped demo adapters on "
                                    "SmolLM2-135M-Instruct), or with --tiny the tiny random demo (idempotent)")
    p.add_argument("--dir", default=DEFAULT_DEMO_DIR)
    p.add_argument("--model", metavar="GGUF", help="the SmolLM2-135M-Instruct GGUF (default: "
                   "$LORASERVE_SMOLLM2, else .venv/models/SmolLM2-135M-Instruct.Q4_1.gguf from `make models`)")
    p.add_argument("--tiny", action="store_true", help="build the tiny random-weight demo bases, "
                   "adapters and catalog instead (no download; what the tests use)")
    p.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    say = lambda line: print(line, file=sys.stderr)  # noqa: E731
    if args.tiny:
        from .demo import build_demo
        paths = build_demo(Path(args.dir), progress=say)
        print(f"demo base (qwen3):     {paths.qwen3}")
        print(f"demo base (qwen3_moe): {paths.qwen3_moe}")
        print(f"demo catalog:          {paths.catalog}")
        return 0
    from .demo import SMOLLM2_ADAPTERS, build_smollm2_demo
    demo = build_smollm2_demo(Path(args.dir), args.model, progress=say)
    print(f"demo base ({demo.served_name}): {demo.base}")
    print(f"demo catalog: {demo.catalog}")
    for adapter_id, (_folder, _prompt, what) in SMOLLM2_ADAPTERS.items():
        print(f"adapter {adapter_id}: {what}")
    print(f"serve it: loraserve serve --model {demo.gguf} --catalog {demo.catalog}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loraserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(sub)
    _add_demo(sub)
    from .cli_catalog import add_subcommands
    add_subcommands(sub)
    from .loadtest import add_subcommand
    add_subcommand(sub)
    from .cli_keys import add_subcommand as add_keys
    add_keys(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if args.command == "serve":  # its settings from --config FILE and $LORASERVE_<FLAG>
        from .cli_config import reparse
        args = reparse(parser, argv, "serve")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # one line on stderr, as DESIGN.md promises
        if os.environ.get("LORASERVE_DEBUG"):
            raise
        print(f"loraserve {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
