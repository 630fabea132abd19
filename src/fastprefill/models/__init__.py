"""Models: the zoo of packaged real models (``zoo``) and the family adapters (``adapters``)."""

from fastprefill.models.zoo import (
    DEFAULT_MODEL,
    ZOO,
    ZooEntry,
    default_cache_dir,
    is_prepared,
    list_models,
    load,
    prepare,
)

__all__ = [
    "DEFAULT_MODEL",
    "ZOO",
    "ZooEntry",
    "default_cache_dir",
    "is_prepared",
    "list_models",
    "load",
    "prepare",
]
