"""Selection rules fixed in code before a sweep runs (which schedule becomes a default).

- :func:`choose_default`: the first sweep's rule (fewest token-layers within a dev F1 tolerance).
- :func:`choose_by_fidelity`: the fidelity rule for LazyLLM's later-cut schedules over
  :data:`FIDELITY_CANDIDATES` (first-token agreement and identical answers with full prefill,
  at a token-layer budget that can reach 2x).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from fastprefill.bench.summary import Summary
from fastprefill.errors import ConfigError
from fastprefill.methods.lazyllm import LATE_SCHEDULES, PRESETS, SELECTIONS, LazyLLM
from fastprefill.methods.pruning import DepthSchedule

__all__ = ["FIDELITY_BUDGET", "FIDELITY_CANDIDATES", "SWEEP_TOLERANCE", "choose_by_fidelity", "choose_default",
           "describe_choice", "fidelity_methods"]

#: Largest mean score loss (0-1 scale) on dev that still counts as "matched accuracy".
SWEEP_TOLERANCE = 0.01

#: Largest mean token-layer fraction a candidate of :func:`choose_by_fidelity` may compute.
FIDELITY_BUDGET = 0.48

#: The fidelity sweep's candidates, ``"<schedule>+<selection>"`` -> (depth schedule, option
#: fields): every later-cut schedule of :data:`~fastprefill.methods.lazyllm.LATE_SCHEDULES`
#: under the paper's rule and under the ``snap`` and ``snap-protect`` bundles.
FIDELITY_CANDIDATES: dict[str, tuple[DepthSchedule, dict[str, Any]]] = {
    (name if selection == "paper" else f"{name}+{selection}"): (PRESETS[name], dict(SELECTIONS[selection]))
    for name in LATE_SCHEDULES for selection in ("paper", "snap", "snap-protect")
}


def fidelity_methods(names: Iterable[str] | None = None, prefix: str = "lazyllm-") -> dict[str, LazyLLM]:
    """The candidates ``names`` (default all) as LazyLLM methods keyed ``prefix + name``.

    Raises:
        ConfigError: a name that is not a candidate.
    """
    chosen = list(FIDELITY_CANDIDATES) if names is None else list(names)
    unknown = [n for n in chosen if n not in FIDELITY_CANDIDATES]
    if unknown:
        raise ConfigError(f"not fidelity candidates: {unknown}; choose from {sorted(FIDELITY_CANDIDATES)}")
    return {f"{prefix}{n}": LazyLLM(preset=n) for n in chosen}


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


def choose_by_fidelity(summaries: Sequence[Summary], budget: float = FIDELITY_BUDGET) -> dict[str, Any]:
    """The fidelity rule, fixed before the sweep runs.

    Among the candidates (every summary but the reference's own) whose mean token-layer fraction
    is at most ``budget`` (0.48: a prefill that can reach 2x), choose the highest fidelity =
    first-token agreement with the reference + the share of answers identical to the
    reference's; ties (equal to 1e-9) go to the lower median first-token KL(reference ||
    candidate), then to fewer token-layers. If no candidate is within the budget, ``chosen`` is
    ``None`` and ``rule`` says so: no other candidate is put in its place.

    Returns:
        ``{"chosen": method or None, "rule": text, "eligible": [methods within the budget],
        "ranking": [{"method", "fidelity", "first_token_kl_median", "token_layer_fraction"},
        ...]}`` with the ranking best first.

    Raises:
        ConfigError: no candidate at all, or an eligible candidate whose records lack the first
            tokens the rule compares (runs not made by the bench runner).
    """
    rows = [s for s in summaries if not s.is_reference]
    if not rows:
        raise ConfigError("choose_by_fidelity: no sweep candidates to choose from (only the reference ran)")
    eligible = [s for s in rows if s.token_layer_fraction <= budget]
    missing = [s.method for s in eligible if s.first_token_agreement is None]
    if missing:
        raise ConfigError(f"choose_by_fidelity: {missing} have no first tokens to compare with the reference; "
                          "run them through fastprefill.bench.runner")

    def fidelity(s: Summary) -> float:
        return round(float(s.first_token_agreement) + s.identical_answers, 9)

    def key(s: Summary) -> tuple[float, float, float]:
        kl = s.first_token_kl_median
        return (-fidelity(s), kl if kl is not None and not math.isnan(kl) else math.inf, s.token_layer_fraction)

    ranking = sorted(eligible, key=key)
    table = [{"method": s.method, "fidelity": fidelity(s), "first_token_kl_median": s.first_token_kl_median,
              "token_layer_fraction": s.token_layer_fraction} for s in ranking]
    if not ranking:
        fewest = min(rows, key=lambda s: s.token_layer_fraction)
        rule = (f"no candidate computes <= {budget:.0%} of the token-layers (the fewest: {fewest.method} at "
                f"{fewest.token_layer_fraction:.1%}); nothing chosen")
        return {"chosen": None, "rule": rule, "eligible": [], "ranking": []}
    rule = (f"highest first-token agreement + identical answers among candidates computing <= {budget:.0%} of "
            "the token-layers; ties: lower median first-token KL, then fewer token-layers")
    return {"chosen": ranking[0].method, "rule": rule, "eligible": [s.method for s in eligible], "ranking": table}


def describe_choice(choice: Mapping[str, Any]) -> str:
    """One line for a choice of :func:`choose_default` or :func:`choose_by_fidelity`."""
    chosen = choice["chosen"] if choice["chosen"] is not None else "none"
    return f"chosen: {chosen} ({choice['rule']})"
