"""Where adapters come from: the resolver contract, the cache dir, and the built-in resolvers
(each a plugin living with its code)."""

from loramux.resolvers.base import Resolver
from loramux.resolvers.cache import adapters_cache_dir, atomic_directory, cache_dir
from loramux.resolvers.collect import RESOLVERS_ENV, collect_resolvers, order_resolvers
from loramux.resolvers.filesystem import FilesystemResolver
from loramux.resolvers.huggingface import HuggingFaceResolver
from loramux.resolvers.settings import ResolverSettings

__all__ = [
    "RESOLVERS_ENV",
    "FilesystemResolver",
    "HuggingFaceResolver",
    "Resolver",
    "ResolverSettings",
    "adapters_cache_dir",
    "atomic_directory",
    "cache_dir",
    "collect_resolvers",
    "order_resolvers",
]
