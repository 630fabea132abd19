"""Method names for the CLI, the server and benchmark configs: ``"name"`` or ``"name:key=value,..."``.

:data:`METHODS` maps each name to its method dataclass, registered as itself. One converter,
:func:`make_method`, turns a spec string's ``key=value`` items into the dataclass's typed fields:

- ``int``, ``float``, ``bool`` (``true/false``, ``1/0``, ``yes/no``, ``on/off``) and ``str``
  fields convert by their annotation (``X | None`` converts as ``X``);
- a tuple of pairs (a pruning schedule) is written ``a:b+c:d``;
- a type with a ``parse`` classmethod (:class:`~fastprefill.methods.pruning.Revival`) parses
  its own text;
- a field typed ``Options | Mapping[str, Any]`` (LazyLLM's ``options``) is *flattened*: the
  spec names the option dataclass's own fields (``revival=none``) and the method receives them
  as a mapping of typed values, applied over its preset's options;
- a field with ``metadata={"spec": False}`` (a model object, checkpoint metadata) is not an
  option.

Examples: ``full``, ``lazyllm:preset=default``, ``lazyllm:preset=cut30k20+snap,revival=none``,
``lazyllm:schedule=8:0.7+16:0.5,selection=snap``, ``static:keep=0.5,select_layer=8``,
``random:keep=0.5,seed=0``, ``kvp:predictor=ckpt/``, ``kvp-prefix:layer=8``,
``runahead:procs=2,partition=searched``, ``runahead:procs=2,partition=600/424``,
``blend:policy=deviation,budget=0.15``,
``tsp:procs=2,timeout_s=60``.

``runahead`` and ``tsp`` build :class:`~fastprefill.methods.base.DistributedMethod` instances:
they run on a rank pool or under torchrun (see ``fastprefill.launch``).
"""

from __future__ import annotations

import dataclasses
import types
import typing
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from transformers import DynamicCache, PreTrainedModel

from fastprefill.errors import ConfigError
from fastprefill.host import dtype_name
from fastprefill.methods.auto import TuneProfile
from fastprefill.methods.base import Method, PrefillOutput
from fastprefill.methods.baselines import GemFilter, RandomDrop, StaticPruning
from fastprefill.methods.full import FullPrefill
from fastprefill.methods.kv_prediction import KVPrediction, KVPrefix
from fastprefill.methods.lazyllm import LazyLLM
from fastprefill.methods.research.blend import Blend
from fastprefill.methods.runahead import KVRunahead, SequenceParallel

__all__ = ["METHODS", "AutoMethod", "MethodEntry", "convert", "make_method", "method_names", "parse_spec"]


@dataclass
class AutoMethod(Method):
    """Choose the method per prompt from a tuning profile (``fastprefill tune`` writes one).

    :meth:`resolve` maps a prompt's length to its bucket's method spec (built once per spec);
    the engine runs that method, and its :meth:`describe` names the choice (``Timing.method``).

    Args:
        profile: path of a :class:`~fastprefill.methods.auto.TuneProfile` JSON file.

    Raises:
        ConfigError: a missing or damaged profile, a bucket spec that does not build; at the
            first prompt, a model other than the profile's (fingerprint) or in another dtype.
    """

    name: ClassVar[str] = "auto"

    profile: str = ""

    def __post_init__(self) -> None:
        if not self.profile:
            raise ConfigError("auto needs a tuning profile: --method auto:profile=FILE (made by `fastprefill tune`)")
        self._profile = TuneProfile.load(self.profile)
        self._methods = {b.method: make_method(b.method) for b in self._profile.buckets}
        self._checked: weakref.WeakKeyDictionary[PreTrainedModel, bool] = weakref.WeakKeyDictionary()

    def check_model(self, model: PreTrainedModel) -> None:  # type: ignore[override]
        """The model must be the one the profile was measured on (weights fingerprint) and run in its
        dtype (checked once per model)."""
        from fastprefill.models.fingerprint import weights_fingerprint

        if model in self._checked:
            return
        dtype = dtype_name(model.dtype)
        if dtype != self._profile.dtype:
            raise ConfigError(f"the tuning profile {self.profile} was measured in {self._profile.dtype} and this model "
                              f"runs in {dtype}: load the model with --dtype {self._profile.dtype}, or tune it in "
                              f"{dtype}")
        if weights_fingerprint(model) != self._profile.fingerprint:
            raise ConfigError(f"the tuning profile {self.profile} was made for {self._profile.model!r}, whose "
                              "weights differ from this model's; tune this model (fastprefill tune --model ...)")
        self._checked[model] = True

    def resolve(self, model: PreTrainedModel, prompt_len: int) -> Method:
        self.check_model(model)
        return self._methods[self._profile.bucket(prompt_len).method]

    def prefill(self, model: PreTrainedModel, input_ids: torch.Tensor, prefix: DynamicCache | None = None) -> PrefillOutput:
        """Prefill with the method :meth:`resolve` chooses for this prompt."""
        return self.resolve(model, int(input_ids.shape[1])).prefill(model, input_ids, prefix)

    def describe(self) -> str:
        return f"auto({Path(self.profile).name})"


@dataclass(frozen=True)
class MethodEntry:
    """A registered method: its dataclass and a one-line help text."""

    cls: type[Method]
    help: str


#: name -> the method dataclass (and its help line).
METHODS: dict[str, MethodEntry] = {
    "full": MethodEntry(FullPrefill, "plain full prefill (the reference)"),
    "lazyllm": MethodEntry(LazyLLM, "LazyLLM dynamic token pruning (options: preset, schedule, selection, "
                                    "score_window, pool_kernel, sinks, keep_recent, accumulate, decode_protect, revival)"),
    "random": MethodEntry(RandomDrop, "random token drop (baseline; options: keep, seed)"),
    "static": MethodEntry(StaticPruning, "static pruning at original positions (baseline; options: keep, select_layer)"),
    "gemfilter": MethodEntry(GemFilter, "GemFilter static pruning, renumbered positions (baseline; options: keep, "
                                        "select_layer, select_depth, kernel)"),
    "kvp": MethodEntry(KVPrediction, "KV Prediction (needs a trained predictor: predictor=DIR)"),
    "kvp-prefix": MethodEntry(KVPrefix, "KV Prediction keeping the first layers exact (options: layer, predictor, tail)"),
    "runahead": MethodEntry(KVRunahead, "KV-Runahead over procs ranks (options: procs, partition, table, timeout_s)"),
    "tsp": MethodEntry(SequenceParallel, "all-gather sequence-parallel prefill, KV-Runahead's baseline "
                                         "(options: procs, timeout_s)"),
    "blend": MethodEntry(Blend, "reuse cached passages' K/V at new positions, recompute a share of their tokens "
                                "(options: policy=deviation|head|attention, budget, check_layer, anchor=lead|zero, "
                                "window, store_mb; the passages come from a ChunkedPrompt)"),
    "auto": MethodEntry(AutoMethod, "the method a tuning profile chooses per prompt length (options: profile)"),
}


def method_names() -> list[str]:
    """The registered method names, sorted."""
    return sorted(METHODS)


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """Split ``"name:k=v,k2=v2"`` into ``("name", {"k": "v", "k2": "v2"})``.

    Raises:
        ConfigError: an item that is not ``key=value``.
    """
    name, _, rest = spec.strip().partition(":")
    kwargs: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ConfigError(f"method option {item!r} in {spec!r} must look like key=value")
        kwargs[key.strip()] = value.strip()
    return name.strip(), kwargs


def _strip_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if args else str
    return annotation


def _pairs(value: str, kinds: tuple[type, type]) -> tuple[tuple[Any, Any], ...]:
    out = []
    for item in value.replace(";", "+").replace(" ", "+").split("+"):
        if not item:
            continue
        a, sep, b = item.partition(":")
        try:
            if not sep:
                raise ValueError
            out.append((kinds[0](a), kinds[1](b)))
        except ValueError:
            raise ValueError(f"schedule item {item!r} must look like layer:keep (e.g. 8:0.7)") from None
    return tuple(out)


def convert(value: str, annotation: Any) -> Any:
    """Convert one spec string to a field's annotated type (see the module docstring).

    Raises:
        ValueError: the text is not a value of that type (the message says what it expected).
        ConfigError: a type's own ``parse`` refused it.
    """
    annotation = _strip_optional(annotation)
    parse = getattr(annotation, "parse", None)
    if isinstance(annotation, type) and callable(parse):
        return parse(value)
    if typing.get_origin(annotation) is tuple:
        args = typing.get_args(annotation)
        if len(args) == 2 and args[1] is Ellipsis and typing.get_origin(args[0]) is tuple:
            return _pairs(value, typing.get_args(args[0]))
    if annotation is bool:
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"not a boolean: {value!r}")
    for typ in (int, float):
        if annotation is typ:
            try:
                return typ(value)
            except ValueError:
                raise ValueError(f"not {'an integer' if typ is int else 'a number'}: {value!r}") from None
    return value


def _flattened(annotation: Any) -> type | None:
    """The option dataclass of a field typed ``Options | Mapping[str, Any]`` (else ``None``)."""
    if typing.get_origin(annotation) not in (typing.Union, types.UnionType):
        return None
    args = typing.get_args(annotation)
    if not any(typing.get_origin(a) in (Mapping, dict) for a in args):
        return None
    return next((a for a in args if dataclasses.is_dataclass(a)), None)


def make_method(spec: str, defaults: Mapping[str, Any] | None = None) -> Method:
    """Build a method from a spec string.

    Args:
        spec: ``"name"`` or ``"name:key=value,..."`` (see the module docstring).
        defaults: values for options the spec leaves out, used only for the options the
            method declares, its own fields or those of a flattened options dataclass (the CLI
            passes ``--procs``, ``--partition`` and ``--timeout`` this way: they reach
            ``runahead`` and ``tsp`` and no other method; the server passes ``revival``, which
            reaches only ``lazyllm``). Options in ``spec`` win.

    Raises:
        ConfigError: unknown method name, unknown option, a value of the wrong type, or a value
            the method refuses (its message names the field).
    """
    name, raw = parse_spec(spec)
    if name not in METHODS:
        raise ConfigError(f"unknown method {name!r}; known methods: {', '.join(method_names())}")
    cls = METHODS[name].cls
    hints = typing.get_type_hints(cls)
    fields = [f.name for f in dataclasses.fields(cls) if f.init and f.metadata.get("spec", True)]
    nested = {f: opt for f in fields if (opt := _flattened(hints[f])) is not None}
    owner: dict[str, tuple[str | None, Any]] = {f: (None, hints[f]) for f in fields if f not in nested}
    for field_name, opt in nested.items():
        for sub in dataclasses.fields(opt):
            owner.setdefault(sub.name, (field_name, typing.get_type_hints(opt)[sub.name]))
    unknown = set(raw) - set(owner)
    if unknown:
        raise ConfigError(f"method {name!r} has no option(s) {sorted(unknown)}; options: {sorted(owner)}")
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        into, annotation = owner[key]
        try:
            typed = convert(value, annotation)
        except ValueError as exc:
            raise ConfigError(f"method {name!r}, option {key!r}: {exc}") from None
        if into is None:
            kwargs[key] = typed
        else:
            kwargs.setdefault(into, {})[key] = typed
    for key, value in (defaults or {}).items():
        if key in owner and key not in raw:
            into, _ = owner[key]
            if into is None:
                kwargs.setdefault(key, value)
            else:
                kwargs.setdefault(into, {}).setdefault(key, value)
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"method {name!r}: {exc}") from None
