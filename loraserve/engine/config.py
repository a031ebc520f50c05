"""Engine configuration: one validated dataclass, passed whole (never **kwargs). The HTTP side's
settings are `server.config.ServerConfig`'s."""
from __future__ import annotations

from dataclasses import dataclass, field

from loraserve.catalog.dtypes import SERVING_DTYPES


@dataclass(slots=True)
class EngineConfig:
    model_dir: str = field(metadata={"help": "base model directory (HF layout)"})
    device: str = field(default="auto", metadata={
        "help": "where the model runs: auto (cuda if torch sees one, else cpu) | cpu | cuda"})
    dtype: str = field(default="auto", metadata={
        "help": "dtype of weights and activations; auto: float32 on CPU, the checkpoint's on CUDA"})
    served_model_name: str | None = field(default=None, metadata={
        "help": "the base model's name in the API", "default": "the model directory's name"})
    tokenizer_name: str | None = field(default=None, metadata={
        "help": "what the Tinker SDK is told the base model is (a Hugging Face id or an absolute "
                "local directory): its get_tokenizer() loads that tokenizer",
        "default": "the served model name"})
    max_batch_size: int = field(default=64, metadata={"help": "sequences in one step"})
    max_waiting: int = field(default=1024, metadata={
        "help": "sequences that may wait beyond a full batch; past it a request gets 429 "
                "with Retry-After"})
    max_model_len: int = field(default=2048, metadata={
        "help": "prompt + output tokens per sequence"})
    max_batched_tokens: int | None = field(default=None, metadata={
        "help": "tokens one prefill step computes; longer prompts are prefilled in chunks (a step "
                "is not preempted: on a CPU one of 4096 tokens held every other request for tens "
                "of seconds)",
        "default": "512 on a CPU (as train_max_tokens: a step and a training slice hold serving "
                   "back alike), 4096 on a GPU"})
    grammar_compile_timeout_s: float = field(default=10.0, metadata={
        "help": "seconds a structured-output grammar may take to compile against the vocabulary "
                "(counted once the tokenizer's grammar setup is done); past it that request gets "
                "a 400 naming the field, and nothing else waits"})
    train_state_dir: str | None = field(default=None, metadata={
        "help": "where Tinker save_weights writes training state (factors, Adam moments); "
                "kept after exit",
        "default": "a new temporary directory, removed at exit"})
    train_max_tokens: int = field(default=512, metadata={
        "help": "tokens of a training pass (Tinker forward/forward_backward) run between two "
                "decode steps: the most a training step holds serving back"})
    block_size: int = field(default=16, metadata={"help": "KV cache tokens per block"})
    kv_cache_mb: int | None = field(default=None, metadata={
        "help": "KV cache size in MiB",
        "default": "a full batch of max-model-len sequences, capped at 1 GiB"})
    num_kv_blocks: int | None = field(default=None, metadata={
        "help": "explicit KV block count (overrides kv_cache_mb; tests, tuning)",
        "default": "from kv_cache_mb"})
    prefix_caching: bool = field(default=True, metadata={
        "help": "reuse the K/V of cached prompt prefixes, per adapter revision"})
    # multi-LoRA
    catalog_dir: str | None = field(default=None, metadata={
        "help": "adapter catalog directory", "default": "no adapters"})
    catalog_readonly: bool = field(default=False, metadata={
        "help": "open the catalog read-only (engine replicas: one process writes, the others "
                "read its committed revisions)"})
    max_gpu_adapters: int = field(default=32, metadata={
        "help": "adapters resident in the device pool at once"})
    max_lora_rank: int = field(default=64, metadata={"help": "largest adapter rank served"})
    gpu_adapter_mb: int | None = field(default=None, metadata={
        "help": "byte bound of the device adapter pool, in MiB",
        "default": "max-gpu-adapters slots of max-lora-rank, capped at 2048 MiB"})
    cpu_cache_mb: int = field(default=512, metadata={
        "help": "byte bound of the CPU adapter cache, in MiB"})
    max_cpu_adapters: int | None = field(default=None, metadata={
        "help": "count bound of the CPU adapter cache, in adapters (on top of --cpu-cache-mb)",
        "default": "none, only the byte bound"})
    lora_backend: str = field(default="auto", metadata={
        "help": "LoRA kernels: auto (triton on CUDA, else torch) | triton | torch"})
    lora_targets: list[str] | None = field(default=None, metadata={
        "help": "module kinds adapters may target", "default": "every kind the base has"})
    pinned_adapters: list[str] = field(default_factory=list, metadata={
        "help": "adapters kept resident in the device pool", "default": "none"})
    adapter_root: str | None = field(default=None, metadata={
        "help": "root that /v1/load_lora_adapter may import PEFT directories from",
        "default": "runtime adapter loading disabled"})
    max_adapter_mb: int = field(default=1024, metadata={
        "help": "largest adapter /v1/load_lora_adapter reads, in MiB (all its files); larger is a 413"})
    adapter_sources: list[str] = field(default_factory=list, metadata={
        "help": "where a requested adapter the catalog lacks is fetched from, tried in order "
                "(repeatable): s3://bucket/prefix/{tenant}/{name} (boto3: AWS_ENDPOINT_URL and the "
                "standard AWS credentials), hf://{tenant}/{name} (huggingface_hub: HF_ENDPOINT, its "
                "cache), /dir/{tenant}/{name}; imported as a revision and served. "
                "/v1/load_lora_adapter takes these URIs as lora_path", "default": "none"})
    source_deadline_s: float = field(default=30.0, metadata={
        "help": "the longest one fetch from one adapter source may take, in all (not per read; "
                "waiting for one of the source's own 2 threads counts); past it the next source is "
                "tried, and a request no source served gets a 503 with Retry-After naming it"})
    catalog_store: str | None = field(default=None, metadata={
        "help": "s3://bucket/prefix[?cache_mb=N], the catalog's durable tier: every write is "
                "published there, an adapter missing here is faulted in from it, promotes there "
                "are followed within ~2 s (polling its change log); with cache_mb, the least "
                "recently used adapters it holds are dropped here past N MiB", "default": "none"})
    pager_workers: int = field(default=4, metadata={"help": "threads paging adapters in"})
    pager_batch: int = field(default=16, metadata={
        "help": "cold adapters one pager thread reads at a time (one catalog transaction per shard); "
                "1 reads them one by one"})
    seed: int = field(default=0, metadata={"help": "seed of the sampler for unseeded requests"})
    compile: str = field(default="auto", metadata={
        "help": "compile the decode step over batch and context buckets: auto (CUDA graphs on "
                "CUDA, captured at start-up; on CPU eager, unless an earlier `on` start measured "
                "compiled graphs faster for this base, machine and release: then those buckets) | "
                "on (torch.compile on CPU, measured every start) | off. "
                "On CPU the server is ready at once and serves eagerly while one low-priority "
                "thread compiles bucket by bucket when the engine is idle (/ready lists what is "
                "still compiling); each batch bucket is used once measured faster than eager "
                "(recorded per base shape, machine and release), and the compiled code is "
                "cached on disk, so a second start compiles nothing. Steps without LoRA tokens "
                "(and with them, at batch <= 4); prefill, MoE bases and batches past the largest "
                "bucket run eagerly"})
    compile_batch_sizes: list[int] | None = field(default=None, metadata={
        "help": "batch buckets of the compiled decode step (repeatable)",
        "default": "1, 2, 4, 8, every multiple of 16 below max-batch-size, and max-batch-size"})
    weight_prepack: str = field(default="auto", metadata={
        "help": "CPU, float32 (and bfloat16 on AVX512-BF16/AMX CPUs): hold the base's linear "
                "weights in oneDNN's blocked layout, packed "
                "once at start-up instead of on every GEMM (batch-32 decode steps 1.3x faster on "
                "an H 512 base): auto (when they outgrow the last-level cache, where packing "
                "pays, and max-batch-size is above 1: one sequence at a time reads plain weights "
                "faster, as matrix-vector products) | on | off. A decode step compiled on the CPU "
                "keeps them packed"})
    quantize: str = field(default="auto", metadata={
        "help": "weight-only quantized base linears, LoRA in float: auto (a GGUF file's Q8_0/Q4_0/"
                "Q4_1 linears served as the file holds them, repacked, unless --dtype names a float "
                "dtype) | none (dequantized, as loaded) | int8 (per output channel) | int4 (group "
                "--quantize-group) from a float checkpoint. The served base's fingerprint names it "
                "(see --allow-quantized-base-adapters)"})
    quantize_group: int | None = field(default=None, metadata={
        "help": "inputs per int4 scale and min (32 | 64 | 128; a layer whose inputs it does not "
                "divide takes the largest that does); with int8 a group instead of per channel",
        "default": "64 for int4 (bench/quant_kernels.py), per channel for int8"})
    allow_quantized_base_adapters: bool = field(default=False, metadata={
        "help": "serve adapters exported for the float base on a base quantized by --quantize "
                "int8|int4 (whose weights differ from it); without it they are refused with a 409. "
                "A GGUF file's repacked base holds the very weights its dequantized base holds and "
                "serves that base's adapters either way"})
    torch_threads: int | None = field(default=None, metadata={
        "help": "CPU intra-op threads (more pay off for large matrices only: a second thread made "
                "the demo base's 1-token requests 2.5x slower, an H 512 base's batches 1.6x faster)",
        "default": "every usable core (the affinity mask, at most OMP_NUM_THREADS) for a base "
                   "whose linear weights outgrow the last-level cache, else all cores but one"})

    @property
    def model_name(self) -> str:
        """The base's name in requests and listings: `served_model_name`, else the model
        directory's last component (one rule for every hosting)."""
        return self.served_model_name or self.model_dir.rstrip("/").split("/")[-1]

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto|cpu|cuda, got {self.device!r}")
        if self.dtype not in ("auto", *SERVING_DTYPES):
            raise ValueError(f"dtype must be auto|{'|'.join(SERVING_DTYPES)}, got {self.dtype!r}")
        if self.weight_prepack not in ("auto", "on", "off"):
            raise ValueError(f"weight_prepack must be auto|on|off, got {self.weight_prepack!r}")
        if self.quantize not in ("auto", "none", "int8", "int4"):
            raise ValueError(f"quantize must be auto|none|int8|int4, got {self.quantize!r}")
        if self.quantize_group not in (None, 32, 64, 128):
            raise ValueError(f"unsupported quantization group size {self.quantize_group}; expected 32|64|128")
        if self.compile not in ("auto", "on", "off"):
            raise ValueError(f"compile must be auto|on|off, got {self.compile!r}")
        if self.compile_batch_sizes is not None and (
                not self.compile_batch_sizes or min(self.compile_batch_sizes) < 1):
            raise ValueError("compile_batch_sizes must be positive batch sizes")
        if self.lora_backend not in ("auto", "triton", "torch"):
            raise ValueError(f"lora_backend must be auto|triton|torch, got {self.lora_backend!r}")
        if self.max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        if not self.grammar_compile_timeout_s > 0:
            raise ValueError(f"grammar_compile_timeout_s must be > 0, got {self.grammar_compile_timeout_s}")
        if self.max_batched_tokens is not None and self.max_batched_tokens < 1:
            raise ValueError("max_batched_tokens must be >= 1")
        for name in ("max_batch_size", "max_model_len", "block_size",
                     "max_gpu_adapters", "max_lora_rank", "cpu_cache_mb", "max_adapter_mb", "pager_workers",
                     "pager_batch", "train_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_cpu_adapters is not None and self.max_cpu_adapters < 1:
            raise ValueError("max_cpu_adapters must be >= 1")
        if self.kv_cache_mb is not None and self.kv_cache_mb < 1:
            raise ValueError("kv_cache_mb must be >= 1")
        if self.adapter_sources:
            # here, not at the top: the engine-core process unpickles its EngineConfig before its
            # heartbeat starts, so this module must import nothing heavy (test_light_imports)
            from loraserve.catalog.sources import Template
        for uri in self.adapter_sources:
            Template(uri)  # CatalogError naming what is wrong with the template
        if self.catalog_store is not None and not self.catalog_store.startswith("s3://"):
            raise ValueError(f"catalog_store must be s3://bucket[/prefix], got {self.catalog_store!r}")


# A prefill step runs whole. On the 2-core dev machine SmolLM2 prefills ~100-1,000 tokens/s, so a
# 4096-token step (eight tenants' 16-prompt evals at once) held every stream for 20-45 s
# (bench/RESULTS.md, training on the real base); 512 tokens is at most a few seconds there.
CPU_PREFILL_TOKENS, GPU_PREFILL_TOKENS = 512, 4096


def prefill_tokens(cfg: EngineConfig, device_type: str) -> int:
    """`max_batched_tokens` as set, else its default for the device the engine runs on."""
    if cfg.max_batched_tokens is not None:
        return cfg.max_batched_tokens
    return CPU_PREFILL_TOKENS if device_type == "cpu" else GPU_PREFILL_TOKENS

