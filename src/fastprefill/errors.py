"""Exceptions raised by fastprefill.

Every error a user can cause derives from :class:`FastprefillError`, and the ones about a bad
value also derive from :class:`ValueError`, so callers can catch either. Messages say what was
wrong and how to fix it. :func:`is_int` and :func:`is_number` are the type checks every settings
validator uses (a ``bool`` is an ``int`` to Python, never to a setting).
"""

from __future__ import annotations

from collections.abc import Iterable


class FastprefillError(Exception):
    """Base class of every error fastprefill raises on purpose."""


class ConfigError(FastprefillError, ValueError):
    """A configuration value (method field, task length, CLI flag) is out of its allowed range."""


def is_int(value: object, low: int | None = None, high: int | None = None) -> bool:
    """Whether ``value`` is an ``int`` (a ``bool`` is not one) in ``[low, high]`` (``None``: no bound)."""
    return (isinstance(value, int) and not isinstance(value, bool) and (low is None or value >= low)
            and (high is None or value <= high))


def is_number(value: object) -> bool:
    """Whether ``value`` is an ``int`` or a ``float`` (a ``bool`` is not one)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_fields(owner: object, checks: Iterable[tuple[str, bool, str]]) -> None:
    """Raise :class:`ConfigError` for the first ``(field, ok, allowed)`` of ``checks`` that is not
    ``ok``: ``"<Class>.<field> must be <allowed>, got <value>"`` (a settings dataclass's
    ``__post_init__``)."""
    for name, ok, allowed in checks:
        if not ok:
            raise ConfigError(f"{type(owner).__name__}.{name} must be {allowed}, got {getattr(owner, name)!r}")


class ModelNotFoundError(FastprefillError, ValueError):
    """A model name is neither in the zoo, nor a local directory, nor loadable by transformers."""


class MissingPackageError(FastprefillError, ImportError):
    """A package that ships model weights or data is not installed (the message has the pip command)."""


class ChecksumError(FastprefillError, ValueError):
    """A packaged file's sha256 does not match the pinned value; nothing was cached."""


class UnsupportedModelError(FastprefillError, ValueError):
    """The model's family is not supported by the requested method (or it is not a causal LM)."""


class PromptError(FastprefillError, ValueError):
    """The prompt is empty, or longer than the model's context allows."""
