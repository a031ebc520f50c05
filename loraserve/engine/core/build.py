"""Engine construction, in one place: the base, and with a catalog the adapter tiers (catalog,
pager, CPU cache, device pool), the manager that drives them and the LoRA wrappers."""
from __future__ import annotations

import logging

import torch

from loraserve import kernels
from loraserve.catalog.base import base_fingerprint, served_fingerprint
from loraserve.catalog.isolated import open_for_serving
from loraserve.catalog.targets import EXPERT_KINDS

from ...adapters.cpu_cache import CpuCache
from ...adapters.manager import AdapterManager
from ...adapters.pager import Pager
from ...adapters.pool import AdapterPool, PoolConfig, TargetSpec
from ...adapters.slabs import Slabs
from ...lora.layers import LoRAState, attach_lora, target_modules, twin_model
from ...model.prepack import PackedLinear, outgrows_last_level_cache
from ..config import EngineConfig
from .background_compile import BackgroundCompile, compile_cache_dir, use_cache_dir
from .decode_graphs import (DecodeGraphs, batch_buckets, choice_cache_path, choice_key, context_buckets,
                            read_choice, write_choice)
from .llm_engine import LLMEngine
from .training import trainer_if_any


log = logging.getLogger(__name__)

DEFAULT_POOL_MB = 2048  # without --gpu-adapter-mb: max_slots x max_rank rows, capped at this


def pool_targets(model: torch.nn.Module, kinds: set[str] | None = None) -> list[TargetSpec]:
    """One TargetSpec per LoRA kind the base has, with the layers that have it."""
    by_kind: dict[str, TargetSpec] = {}
    for kind, layer, _, mod in target_modules(model):
        if kinds is not None and kind not in kinds:
            continue
        inner = getattr(mod, "base", mod)  # a LoRA wrapper's target
        if kind in EXPERT_KINDS:
            experts, h_out, h_in = inner.weight.shape  # [E, out, in]
        else:  # no weight read: a packed or fused base's would be a copy
            experts, h_out, h_in = 0, inner.out_features, inner.in_features
        spec = by_kind.get(kind)
        if spec is None:
            by_kind[kind] = TargetSpec(kind=kind, layers=[layer], h_in=h_in, h_out=h_out, experts=experts)
        else:
            spec.layers.append(layer)
    return list(by_kind.values())


def _healer(cfg: EngineConfig, catalog):
    """With `--catalog-store`, what heals a blob failing its checksum from the store."""
    if not cfg.catalog_store:
        return None
    from loraserve.catalog.store_heal import BlobHealer
    from loraserve.catalog.store_s3 import ObjectStore, parse_store_uri
    return BlobHealer(catalog, ObjectStore(parse_store_uri(cfg.catalog_store)[0]))


def build_engine(cfg: EngineConfig) -> LLMEngine:
    """An LLMEngine; with cfg.catalog_dir, serving adapters from that catalog; with its decode
    step compiled where cfg.compile asks for it (after the LoRA wrappers are attached): on CUDA
    captured now, on the CPU in the background while the engine serves eagerly
    (`engine.compiler`, engine.core.background_compile); warmed up (`LLMEngine.warm_up`)."""
    engine = LLMEngine(cfg)
    if cfg.catalog_dir is not None:
        _enable_lora(engine, cfg)
    if compiles(cfg, engine):
        engine.runner.graphs = _compile_decode(engine, cfg)
    engine.warm_up()  # a user's first request is not the one that pages the weights in
    return engine


def _compile_decode(engine: LLMEngine, cfg: EngineConfig) -> DecodeGraphs | None:
    """The decode step's graphs: CUDA graphs captured now; on the CPU, graphs a background
    thread makes over a twin of the model (`BackgroundCompile`, started here), each batch bucket
    admitted once measured faster than eager. `on` measures every start and records the
    measurement per base shape, machine and code (`choice_cache_path`); `auto` compiles only the
    buckets such a measurement found faster compiled, and nothing without one. None when nothing
    is to be compiled."""
    sizes = tuple(sorted(set(cfg.compile_batch_sizes or batch_buckets(cfg.max_batch_size))))
    contexts = context_buckets(engine.max_model_len, cfg.block_size)
    if engine.device.type != "cpu":
        graphs = DecodeGraphs(engine.model, engine.cache, engine.device, engine.runner.lora,
                              engine.scratch_block, sizes, contexts)
        graphs.warm_up()
        return graphs
    packed = any(isinstance(m, PackedLinear) for m in engine.model.modules())
    cache, key = choice_cache_path(), choice_key(engine.model_config, engine.dtype, sizes, packed)
    remembered = read_choice(cache, key) if cfg.compile == "auto" else None
    if cfg.compile == "auto" and remembered is None:
        # eager unless measured otherwise: on the CPU the eager step (fused C++ ops, no Python
        # slices) beat the compiled graphs at every bucket measured (SmolLM2-135M f32/Q4_1,
        # 0.6B shapes: bench/RESULTS.md), and a background compile takes the GIL and the cores
        # from the requests served meanwhile. `--compile on` measures, and records what it found
        log.info("decode step eager (--compile on measures compiled graphs on this machine)")
        return None
    if remembered is not None and remembered >= set(sizes):
        log.info("decode step eager: compiled was slower at every batch bucket here (%s)", cache)
        return None
    use_cache_dir(compile_cache_dir(key))
    lora = engine.runner.lora
    twin = lora.fork() if lora is not None else None
    graphs = DecodeGraphs(twin_model(engine.model, lora, twin), engine.cache, engine.device, twin,
                          engine.scratch_block, sizes, contexts)
    def idle() -> bool:  # nothing to serve, and no training slice queued
        trainer = trainer_if_any(engine)
        return not engine.has_work() and (trainer is None or not trainer.has_queued)

    engine.compiler = BackgroundCompile(graphs, idle, remembered,
                                        on_measured=lambda g: write_choice(cache, key, g),
                                        on_change=lambda: engine._notify()).start()
    return graphs


def compiles(cfg: EngineConfig, engine: LLMEngine) -> bool:
    """Whether the decode step is compiled: `on`; `auto` on CUDA, and on the CPU for a base whose
    weights outgrow the last-level cache (its steps stream weights; a small base's are cheap to
    dispatch eagerly and not worth the compile); never for MoE bases, whose expert routing has
    data-dependent shapes. On the CPU only the batch buckets measured faster compiled use the
    graphs (`DecodeGraphs.choose`)."""
    if cfg.compile == "off" or engine.model_config.is_moe:
        return False
    if cfg.compile == "on" or engine.device.type == "cuda":
        return True
    return engine.device.type == "cpu" and outgrows_last_level_cache(engine.model)


def _enable_lora(engine: LLMEngine, cfg: EngineConfig) -> None:
    kinds = set(cfg.lora_targets) if cfg.lora_targets else None
    specs = pool_targets(engine.model, kinds)
    pool = AdapterPool(specs, PoolConfig(
        max_slots=cfg.max_gpu_adapters, max_rank=cfg.max_lora_rank,
        max_bytes=(cfg.gpu_adapter_mb or DEFAULT_POOL_MB) * 2**20,
        device=str(engine.device), dtype=engine.dtype))
    catalog = open_for_serving(cfg.catalog_dir, readonly=cfg.catalog_readonly)  # shard hosts map the shards
    fingerprint = served_fingerprint(base_fingerprint(cfg.model_dir), engine.quantization,
                                     cfg.allow_quantized_base_adapters)
    cpu_cache = CpuCache(cfg.cpu_cache_mb * 2**20, pin_memory=engine.device.type == "cuda",
                         max_entries=cfg.max_cpu_adapters)
    pager = Pager(catalog, cpu_cache, fingerprint, workers=cfg.pager_workers, batch=cfg.pager_batch,
                  compute_dtype=str(engine.dtype).removeprefix("torch."), healer=_healer(cfg, catalog))
    pager.slabs = Slabs.for_pool(pool, pin_memory=cpu_cache.pin_memory)  # the CPU tier's layout
    manager = AdapterManager(catalog, pool, cpu_cache, pager, fingerprint)
    manager.decode_on_engine_thread()
    state = LoRAState(pool, kernels.LoRAOps(cfg.lora_backend, engine.device))  # backend chosen once
    attach_lora(engine.model, state, kinds)
    engine.enable_lora(manager, state)
    for ref in cfg.pinned_adapters:
        manager.pin(ref)
