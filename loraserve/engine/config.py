"""Engine configuration: one validated dataclass, passed whole (never **kwargs)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class EngineConfig:
    model_dir: str
    device: str = "auto"             # auto | cpu | cuda
    dtype: str = "auto"              # auto | float32 | bfloat16 | float16
    served_model_name: str | None = None
    max_batch_size: int = 64         # sequences in one step
    max_model_len: int = 2048        # prompt + output tokens per sequence
    max_batched_tokens: int = 4096   # tokens in one prefill step; longer prompts run in chunks
    block_size: int = 16             # KV cache tokens per block
    kv_cache_mb: int | None = None   # None: sized from max_batch_size * max_model_len (capped)
    num_kv_blocks: int | None = None  # explicit block count (overrides kv_cache_mb; tests, tuning)
    prefix_caching: bool = True      # reuse the K/V of cached prompt prefixes (per adapter revision)
    # multi-LoRA
    catalog_dir: str | None = None
    max_gpu_adapters: int = 32
    max_lora_rank: int = 64
    gpu_adapter_mb: int | None = None
    cpu_cache_mb: int = 512
    lora_backend: str = "auto"       # auto | triton | torch
    lora_targets: list[str] | None = None  # None: every kind the base has
    pinned_adapters: list[str] = field(default_factory=list)
    adapter_root: str | None = None  # /v1/load_lora_adapter only imports PEFT dirs under this root
    pager_workers: int = 4
    seed: int = 0
    torch_threads: int | None = None  # CPU intra-op threads; None: all cores but one (the server's)

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto|cpu|cuda, got {self.device!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto|float32|bfloat16|float16, got {self.dtype!r}")
        if self.lora_backend not in ("auto", "triton", "torch"):
            raise ValueError(f"lora_backend must be auto|triton|torch, got {self.lora_backend!r}")
        for name in ("max_batch_size", "max_model_len", "max_batched_tokens", "block_size",
                     "max_gpu_adapters", "max_lora_rank", "cpu_cache_mb", "pager_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.kv_cache_mb is not None and self.kv_cache_mb < 1:
            raise ValueError("kv_cache_mb must be >= 1")
