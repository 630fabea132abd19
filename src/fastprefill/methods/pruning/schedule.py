"""Pruning schedules and keep fractions: validation, resolution against a model, token-layer counts.

A *schedule* is ``((layer, keep), ...)``: after pruning layer ``layer`` only ``keep_count(keep, n)``
tokens are computed in the layers above. A *depth schedule* is the same with relative depths in
``[0, 1)``, resolved against the model's layer count by :func:`resolve_depth_schedule`. Keep
fractions are fractions of the whole sequence, so they must not grow with depth.
"""

from __future__ import annotations

import math
from typing import Any

from fastprefill.errors import ConfigError, is_int, is_number

__all__ = [
    "DepthSchedule",
    "Schedule",
    "check_depth_schedule",
    "check_keep",
    "check_layers",
    "check_schedule",
    "keep_count",
    "resolve_depth_schedule",
    "schedule_token_layers",
    "scored_layers",
]

Schedule = tuple[tuple[int, float], ...]
DepthSchedule = tuple[tuple[float, float], ...]


def keep_count(fraction: float, n: int) -> int:
    """Tokens kept by a keep fraction of a length-``n`` sequence: ``ceil(fraction * n)`` in ``[1, n]``."""
    return max(1, min(n, math.ceil(fraction * n - 1e-9)))


def check_keep(keep: Any, fieldname: str = "keep") -> float:
    """``keep`` as a float in ``(0, 1]``, or a :class:`ConfigError` naming ``fieldname``."""
    if not is_number(keep) or not 0.0 < float(keep) <= 1.0:
        raise ConfigError(f"{fieldname} must be a fraction in (0, 1], got {keep!r}")
    return float(keep)


def _check_fractions(pairs: tuple[tuple[Any, float], ...], fieldname: str) -> None:
    prev = 1.0
    for where, frac in pairs:
        if not isinstance(frac, (int, float)) or not 0.0 < float(frac) <= 1.0:
            raise ConfigError(f"{fieldname}: keep fraction at {where} must lie in (0, 1], got {frac!r}")
        if frac > prev + 1e-12:
            raise ConfigError(
                f"{fieldname}: keep fractions must not grow with depth (they are fractions of the whole "
                f"prompt), got {frac} at {where} after {prev}"
            )
        prev = float(frac)


def _pairs(value: Any, fieldname: str, first: str) -> tuple[tuple[Any, Any], ...]:
    """``value`` as a tuple of pairs, or a :class:`ConfigError` naming ``fieldname``."""
    try:
        return tuple((a, b) for a, b in value)
    except (TypeError, ValueError):
        raise ConfigError(f"{fieldname} must be a sequence of ({first}, keep_fraction) pairs, got {value!r}") from None


def check_schedule(schedule: Any) -> Schedule:
    """Validate the shape, order and fractions of an absolute schedule (layer counts come later)."""
    pairs = _pairs(schedule, "schedule", "layer")
    prev = -1
    for layer, _ in pairs:
        if not is_int(layer, 0):
            raise ConfigError(f"schedule: pruning layer must be an integer >= 0, got {layer!r}")
        if layer <= prev:
            raise ConfigError(
                f"schedule: pruning layers must be strictly increasing (sorted, no repeats), got {layer} after {prev}"
            )
        prev = layer
    _check_fractions(pairs, "schedule")
    return tuple((int(layer), float(frac)) for layer, frac in pairs)


def check_depth_schedule(depth_schedule: Any) -> DepthSchedule:
    """Validate a relative schedule: depths strictly increasing in ``[0, 1)``, fractions as in :func:`check_schedule`."""
    depth = _pairs(depth_schedule, "depth_schedule", "depth")
    prev = -1.0
    for d, _ in depth:
        if not is_number(d) or not 0.0 <= d < 1.0 or d <= prev:
            raise ConfigError(f"depth_schedule: depths must be strictly increasing in [0, 1), got {d} after {prev}")
        prev = d
    _check_fractions(depth, "depth_schedule")
    return tuple((float(d), float(f)) for d, f in depth)


def resolve_depth_schedule(depth_schedule: DepthSchedule, num_layers: int) -> Schedule:
    """Turn ``(relative depth, keep)`` pairs into ``(layer, keep)`` for an ``L``-layer model.

    Layer = ``min(floor(depth * L), L - 2)``. Pairs that land on the same layer (shallow models)
    merge into one, keeping the smaller fraction (the deeper pair's).
    """
    out: dict[int, float] = {}
    for depth, frac in depth_schedule:
        layer = min(math.floor(depth * num_layers), num_layers - 2)
        out[layer] = min(frac, out.get(layer, 1.0))
    return tuple(sorted(out.items()))


def check_layers(schedule: Schedule, num_layers: int, what: str = "schedule") -> None:
    """Raise :class:`ConfigError` unless every pruning layer lies in ``[0, L - 2]``.

    Pruning at the last layer ``L - 1`` would prune nothing (no layer follows it).
    """
    for layer, _ in schedule:
        if layer > num_layers - 2:
            raise ConfigError(
                f"{what}: pruning layer {layer} out of range for a {num_layers}-layer model; "
                f"allowed 0..{num_layers - 2} (a layer after which some layer still runs)"
            )


def schedule_token_layers(schedule: Schedule, num_layers: int, prompt_len: int) -> int:
    """Prompt (token, layer) pairs a prefill with ``schedule`` computes (exact, by :func:`keep_count`)."""
    total, n, prune = 0, prompt_len, dict(schedule)
    for layer in range(num_layers):
        total += n
        if layer in prune:
            n = min(n, keep_count(prune[layer], prompt_len))
    return total


def scored_layers(schedule: Schedule, accumulate: bool) -> set[int]:
    """The layers whose scores a cut uses: the pruning layers, or every layer up to the last one
    when scores ``accumulate`` over a stage."""
    prune = {layer for layer, _ in schedule}
    if accumulate and prune:
        return set(range(max(prune) + 1))
    return prune
