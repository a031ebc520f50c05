"""Write a random Qwen3 base of chosen size in Hugging Face layout (for benchmarks).

    python scripts/make_base.py OUT_DIR [--hidden 1024] [--layers 8] [--intermediate 3072] [--heads 16]
"""
from __future__ import annotations

import argparse

from loraserve.model.tiny import random_model, tiny_config, write_tokenizer_files
from loraserve.model.writer import save_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=3072)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    args = ap.parse_args()
    cfg = tiny_config(hidden_size=args.hidden, num_layers=args.layers, intermediate_size=args.intermediate,
                      num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.hidden // args.heads)
    save_checkpoint(random_model(cfg), args.out)
    write_tokenizer_files(args.out)
    print(args.out)


if __name__ == "__main__":
    main()
