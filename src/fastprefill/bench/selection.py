"""Selection rules fixed in code before a sweep runs (which schedule becomes a default)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastprefill.bench.summary import Summary
from fastprefill.errors import ConfigError

__all__ = ["SWEEP_TOLERANCE", "choose_default"]

#: Largest mean score loss (0-1 scale) on dev that still counts as "matched accuracy".
SWEEP_TOLERANCE = 0.01


def choose_default(summaries: Sequence[Summary], tolerance: float = SWEEP_TOLERANCE) -> dict[str, Any]:
    """The dev sweep's rule over the candidates' summaries (the reference's own is ignored).

    The candidate computing the fewest token-layers whose mean paired score loss against the
    reference is at most ``tolerance``; if none qualifies, the one losing the least (ties: fewer
    token-layers).

    Returns:
        ``{"chosen": method, "rule": text, "qualifying": [methods within tolerance]}``.

    Raises:
        ConfigError: no candidate to choose from.
    """
    rows = [s for s in summaries if not s.is_reference]
    if not rows:
        raise ConfigError("choose_default: no sweep candidates to choose from (only the reference ran)")
    ok = [s for s in rows if s.score_diff >= -tolerance]
    if ok:
        best = min(ok, key=lambda s: s.token_layer_fraction)
        rule = f"fewest token-layers with mean dev F1 loss <= {100 * tolerance:.0f} point(s)"
    else:
        best = max(rows, key=lambda s: (s.score_diff, -s.token_layer_fraction))
        rule = f"no schedule within {100 * tolerance:.0f} point(s): the smallest mean dev F1 loss"
    return {"chosen": best.method, "rule": rule, "qualifying": [s.method for s in ok]}
