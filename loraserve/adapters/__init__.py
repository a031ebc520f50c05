"""Adapter residency: the device pool, the CPU cache and the pager that feeds them.

    catalog (disk) --Pager (threads, single-flight)--> CpuCache (bytes-bounded LRU)
                   --engine thread: AdapterPool.load--> AdapterPool (slots/rows-bounded, refcounted)

Plain state machines: no model, no engine. Keys are `(adapter_id, revision)`.
"""
from loraserve.adapters.cpu_cache import CpuCache
from loraserve.adapters.pager import Pager, record_key
from loraserve.adapters.pool import AdapterPool, PoolConfig, PoolFull
from loraserve.adapters.stats import CacheStats, PagerStats, PoolStats
from loraserve.adapters.targets import TargetSpec, tensor_names

__all__ = ["AdapterPool", "CacheStats", "CpuCache", "Pager", "PagerStats", "PoolConfig",
           "PoolFull", "PoolStats", "TargetSpec", "record_key", "tensor_names"]
