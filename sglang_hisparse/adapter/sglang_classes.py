"""The SGLang classes our pools subclass, named in one place.

The pools (:mod:`sglang_hisparse.pools`) are drop-in replacements of SGLang
classes, so they derive from SGLang's bases; they import those bases from
here, so that a release that moves one is a change to this module alone.
"""

from sglang.srt.mem_cache.allocator import (  # noqa: F401
    BaseTokenToKVPoolAllocator,
    PagedTokenToKVPoolAllocator,
)
from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4SingleKVPool  # noqa: F401
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool  # noqa: F401
from sglang.srt.mem_cache.memory_pool_host import HostKVCache  # noqa: F401

from sglang_hisparse.adapter import releases

# 0.5.17 moved it into mem_cache/pool_host/mla.py.
MLATokenToKVPoolHost = releases.current.mla_host_pool_class()
