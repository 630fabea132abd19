"""Method names for the CLI and benchmark configs: ``"name"`` or ``"name:key=value,key=value"``.

Examples: ``full``, ``lazyllm:preset=default``, ``static:keep=0.5,select_layer=8``,
``random:keep=0.5,seed=0``, ``kvp:predictor=ckpt/``, ``kvp-prefix:layer=8``,
``kvp-prefix:predictor=ckpt/``, ``runahead:procs=2,partition=searched``,
``runahead:procs=2,partition=600/424``, ``tsp:procs=2,timeout_s=60``.

``runahead`` and ``tsp`` build :class:`~fastprefill.methods.base.DistributedMethod` instances:
they run on a rank pool or under torchrun (see ``fastprefill.launch``).

Method modules are imported only when their name is used, so a missing optional piece never
breaks the others.
"""

from __future__ import annotations

import dataclasses
import importlib
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

from fastprefill.errors import ConfigError
from fastprefill.methods.base import Method

#: name -> ("module:attribute", help). The attribute is a Method class or a factory taking kwargs.
METHODS: dict[str, tuple[str, str]] = {
    "full": ("fastprefill.methods.full:FullPrefill", "plain full prefill (the reference)"),
    "lazyllm": ("fastprefill.methods.lazyllm:LazyLLM.from_spec", "LazyLLM dynamic token pruning"),
    "random": ("fastprefill.methods.baselines:RandomDrop", "random token drop (baseline)"),
    "static": ("fastprefill.methods.baselines:StaticPruning", "static pruning at original positions (baseline)"),
    "gemfilter": ("fastprefill.methods.baselines:GemFilter", "GemFilter static pruning, renumbered positions (baseline)"),
    "kvp": ("fastprefill.methods.kv_prediction:KVPrediction.from_spec", "KV Prediction (needs a trained predictor)"),
    "kvp-prefix": ("fastprefill.methods.kv_prediction.prefix:KVPrefix",
                   "KV Prediction keeping the first layers exact (options: layer, predictor)"),
    "runahead": ("fastprefill.methods.runahead.method:KVRunahead",
                 "KV-Runahead over procs ranks (options: procs, partition, table, timeout_s)"),
    "tsp": ("fastprefill.methods.runahead.method:SequenceParallel",
            "all-gather sequence-parallel prefill, KV-Runahead's baseline (options: procs, timeout_s)"),
}


def _resolve(target: str) -> Callable[..., Method]:
    module_name, _, attr_path = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr_path.split("."):
        obj = getattr(obj, part)
    return obj


def _convert(value: str, annotation: Any) -> Any:
    """Convert a CLI string to a dataclass field's annotated type (int, float, bool, str; an
    optional ``X | None`` converts to ``X``)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        annotation = next((a for a in typing.get_args(annotation) if a is not type(None)), str)
    text = str(annotation)
    if annotation in (bool, "bool") or text == "bool":
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"not a boolean: {value!r}")
    for typ in (int, float):
        if annotation in (typ, typ.__name__) or text == typ.__name__:
            try:
                return typ(value)
            except ValueError:
                raise ValueError(f"not {'an integer' if typ is int else 'a number'}: {value!r}") from None
    return value


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """Split ``"name:k=v,k2=v2"`` into ``("name", {"k": "v", "k2": "v2"})``."""
    name, _, rest = spec.strip().partition(":")
    kwargs: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ConfigError(f"method option {item!r} in {spec!r} must look like key=value")
        kwargs[key.strip()] = value.strip()
    return name.strip(), kwargs


def make_method(spec: str, defaults: Mapping[str, Any] | None = None) -> Method:
    """Build a method from a spec string.

    Args:
        spec: ``"name"`` or ``"name:key=value,..."`` (see the module docstring).
        defaults: typed values for options the spec leaves out, used only for the options the
            method declares (the CLI passes ``--procs``, ``--partition`` and ``--timeout`` this
            way: they reach ``runahead`` and ``tsp`` and no other method). Options in ``spec``
            win.

    Raises:
        ConfigError: unknown method name, unknown option, or a value of the wrong type.
    """
    name, raw = parse_spec(spec)
    if name not in METHODS:
        known = ", ".join(sorted(METHODS))
        raise ConfigError(f"unknown method {name!r}; known methods: {known}")
    target = _resolve(METHODS[name][0])
    kwargs: dict[str, Any] = dict(raw)
    if dataclasses.is_dataclass(target):
        hints = typing.get_type_hints(target)
        fields = {f.name for f in dataclasses.fields(target) if f.init}
        unknown = set(raw) - fields
        if unknown:
            raise ConfigError(f"method {name!r} has no option(s) {sorted(unknown)}; options: {sorted(fields)}")
        kwargs = {}
        for key, value in raw.items():
            try:
                kwargs[key] = _convert(value, hints.get(key, str))
            except ValueError as exc:
                raise ConfigError(f"method {name!r}, option {key!r}: {exc}") from None
        for key, value in (defaults or {}).items():
            if key in fields:
                kwargs.setdefault(key, value)
    try:
        return target(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"method {name!r}: {exc}") from None
