"""vLLM `serve` flags that loraserve has no option of the same name for: each is either accepted
because it asks for what loraserve does anyway (or sets one of our options), or refused at once
with one line that names the loraserve way to get the same thing. A vLLM command line therefore
starts the server or says in one line what to change; no flag is taken and ignored.

The aliases that are the same option under a vLLM name (`--max-loras`, ...) live in
cli.VLLM_ALIASES; the flags with their own meaning (`--gpu-memory-utilization`,
`--tool-call-parser`, `--lora-modules`, ...) are cli's own options.
"""
from __future__ import annotations

import argparse
from typing import Any

# flag -> (takes a value, what to use instead): refused with that line
INSTEAD: dict[str, tuple[bool, str]] = {
    "--quantization": (True, "use --quantize int8|int4 (weight-only, LoRA in float); a GGUF file's "
                             "Q8_0/Q4_0/Q4_1/Q4_K/Q5_K weights and an AWQ or GPTQ checkpoint are "
                             "served quantized as they are"),
    "--chat-template": (True, "the base's own chat template is the only one (tokenizer_config.json, "
                              "chat_template.jinja or the GGUF file's metadata)"),
    "--seed": (True, "sampling is seeded per request: send the request field `seed`"),
    "--download-dir": (True, "no model hub is read: pass a local directory or .gguf file as MODEL"),
    "--revision": (True, "no model hub is read: pass a local directory or .gguf file as MODEL"),
    "--load-format": (True, "the format is read off MODEL: a Hugging Face directory (safetensors) "
                            "or a .gguf file"),
    "--kv-cache-dtype": (True, "the KV cache is kept in the serving dtype (--dtype); size it with "
                               "--kv-cache-mb or --gpu-memory-utilization"),
    "--block-size": (True, "the KV block size is fixed; size the cache with --kv-cache-mb"),
    "--swap-space": (True, "no KV swap to the host; size the cache with --kv-cache-mb"),
    "--uvicorn-log-level": (True, "use --log-level (the server's and uvicorn's lines alike)"),
    "--disable-log-requests": (False, "the one access line per request is a log record: "
                                      "--log-level warning leaves it out"),
    "--disable-log-stats": (False, "loraserve logs no periodic stats; /metrics has them"),
    "--max-logprobs": (True, "top logprobs are capped at 20 per token, as OpenAI's API"),
    "--lora-dtype": (True, "adapters are served in the base's dtype (--dtype)"),
    "--lora-extra-vocab-size": (True, "adapters add no tokens to the vocabulary"),
    "--fully-sharded-loras": (False, "one device per engine: scale out with --replicas N"),
    "--guided-decoding-backend": (True, "structured output always uses xgrammar"),
    "--structured-outputs-config": (True, "structured output always uses xgrammar"),
    "--reasoning-parser": (True, "reasoning is not split from the answer: the text comes back whole"),
    "--distributed-executor-backend": (True, "one device per engine: scale out with --replicas N "
                                             "(Ray Serve)"),
}

# parallelism flags: a size of 1 is what loraserve runs; anything else is refused
PARALLEL: dict[str, tuple[str, str]] = {
    "--tensor-parallel-size": ("-tp", "one device per engine: scale out with --replicas N (Ray Serve), "
                                      "each replica on its own device"),
    "--pipeline-parallel-size": ("-pp", "one device per engine: scale out with --replicas N (Ray Serve)"),
    "--data-parallel-size": ("-dp", "use --replicas N: N engine replicas behind Ray Serve"),
}


class _Refuse(argparse.Action):
    """Stops parsing with one line: the flag and what to use instead."""

    def __init__(self, option_strings: list[str], dest: str, instead: str = "", **kwargs: Any):
        self.instead = instead
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(f"{option_string} (vLLM) is not a loraserve option: {self.instead}")


def _size_one(flag: str, instead: str):
    def check(value: str) -> int:
        if value.strip() != "1":
            raise argparse.ArgumentTypeError(f"{value!r}: only 1 ({instead})")
        return 1
    check.__name__ = flag  # argparse names the type in its message
    return check


def add_vllm_flags(p: argparse.ArgumentParser) -> None:
    """The vLLM flags above on the `serve` parser (hidden from --help except their group line)."""
    group = p.add_argument_group(
        "vLLM flags", "accepted where they ask for what loraserve does, else refused with the "
                      "loraserve way in one line")
    group.add_argument("--enforce-eager", dest="compile", action="store_const", const="off",
                       help="vLLM's: the same as --compile off")
    group.add_argument("--enable-prefix-caching", dest="prefix_caching", action="store_const",
                       const=True, help="vLLM's: prefix caching is on unless --no-prefix-caching")
    group.add_argument("--no-enable-prefix-caching", dest="prefix_caching", action="store_const",
                       const=False, help="vLLM's: the same as --no-prefix-caching")
    group.add_argument("--trust-remote-code", action="store_true",
                       help="accepted and does nothing: loraserve runs no code from a checkpoint "
                            "(the supported families are built in)")
    group.add_argument("--enable-chunked-prefill", action="store_true",
                       help="accepted and does nothing: long prompts are always prefilled in "
                            "chunks of --max-batched-tokens")
    for flag, (short, instead) in PARALLEL.items():
        group.add_argument(flag, short, type=_size_one(flag, instead), default=1,
                           dest=flag.strip("-").replace("-", "_"), metavar="1",
                           help=f"vLLM's: only 1 ({instead})")
    for flag, (takes_value, instead) in INSTEAD.items():
        group.add_argument(flag, action=_Refuse, instead=instead, nargs=None if takes_value else 0,
                           dest=f"vllm_{flag.strip('-').replace('-', '_')}", help=argparse.SUPPRESS)
