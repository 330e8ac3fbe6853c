"""Prefix caching (RadixAttention): the interface and its radix-tree implementation."""

from services.scheduler.cache.base import MatchResult, PrefixCache
from services.scheduler.cache.radix import RadixCache

__all__ = ["MatchResult", "PrefixCache", "RadixCache"]
