"""`loraserve` command line: serve, demo, export, catalog ..., loadtest."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

DEFAULT_DEMO_DIR = ".loraserve/demo"


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve the OpenAI-compatible API")
    p.add_argument("--model", help="base model directory (HF layout); default: the demo base")
    p.add_argument("--catalog", help="adapter catalog directory; default: the demo catalog with the demo base")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--max-gpu-adapters", type=int, default=32)
    p.add_argument("--gpu-adapter-mb", type=int, default=None, help="byte bound of the device adapter pool")
    p.add_argument("--max-lora-rank", type=int, default=64)
    p.add_argument("--cpu-cache-mb", type=int, default=512)
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-mb", type=int, default=None)
    p.add_argument("--max-batched-tokens", type=int, default=4096,
                   help="tokens one prefill step computes; longer prompts are prefilled in chunks")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="recompute every prompt (default: reuse the K/V of cached prompt prefixes)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--lora-backend", default="auto", choices=["auto", "triton", "torch"])
    p.add_argument("--pin", action="append", default=[], metavar="ID", help="keep this adapter resident")
    p.add_argument("--adapter-root", default=None, help="root that /v1/load_lora_adapter may import from")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="CPU intra-op threads (default: all cores but one)")
    p.add_argument("--api-key", default=os.environ.get("LORASERVE_API_KEY"))
    p.add_argument("--demo-dir", default=DEFAULT_DEMO_DIR)
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from .engine.async_engine import AsyncEngine
    from .engine.config import EngineConfig
    from .server.app import run_server

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model, catalog = args.model, args.catalog
    if model is None:
        from .demo import build_demo
        demo = build_demo(Path(args.demo_dir))
        model, catalog = str(demo.qwen3), catalog or str(demo.catalog)
    cfg = EngineConfig(
        model_dir=model, device=args.device, dtype=args.dtype, served_model_name=args.served_model_name,
        max_batch_size=args.max_batch_size, max_model_len=args.max_model_len, kv_cache_mb=args.kv_cache_mb,
        catalog_dir=catalog, max_gpu_adapters=args.max_gpu_adapters, max_lora_rank=args.max_lora_rank,
        gpu_adapter_mb=args.gpu_adapter_mb, cpu_cache_mb=args.cpu_cache_mb, lora_backend=args.lora_backend,
        pinned_adapters=args.pin, adapter_root=args.adapter_root, torch_threads=args.torch_threads,
        prefix_caching=args.prefix_caching, max_batched_tokens=args.max_batched_tokens)
    engine = AsyncEngine.from_config(cfg)
    run_server(engine, host=args.host, port=args.port, api_key=args.api_key, log_level=args.log_level.lower())
    return 0


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="build the tiny demo bases, demo adapters and demo catalog (idempotent)")
    p.add_argument("--dir", default=DEFAULT_DEMO_DIR)
    p.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    from .demo import build_demo
    paths = build_demo(Path(args.dir), progress=lambda line: print(line, file=sys.stderr))
    print(f"demo base (qwen3):     {paths.qwen3}")
    print(f"demo base (qwen3_moe): {paths.qwen3_moe}")
    print(f"demo catalog:          {paths.catalog}")
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
