"""Prefix caching (RadixAttention): the interface, its radix-tree implementation, the null cache of
``--disable-radix-cache``, and the small prefix set of the in-batch dedup."""

from services.scheduler.cache.base import (CacheHandle, InsertResult, MatchResult, NoPrefixCache, PeekResult,
                                           PrefixCache)
from services.scheduler.cache.prefix_set import PrefixSet
from services.scheduler.cache.radix import RadixCache

__all__ = ["CacheHandle", "InsertResult", "MatchResult", "NoPrefixCache", "PeekResult", "PrefixCache", "PrefixSet",
           "RadixCache"]
