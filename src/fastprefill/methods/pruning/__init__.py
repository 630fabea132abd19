"""The token-pruning mechanism shared by LazyLLM and its baselines (policies over it).

The mechanism runs the model layer by layer on gathered rows and counts every (layer, position)
it computes: at prefill (:mod:`~fastprefill.methods.pruning.prefill`) it defers pruned tokens to
the Aux Cache; while decoding (:mod:`~fastprefill.methods.pruning.decode`) it revives them. What
the prefill leaves for decoding is :mod:`~fastprefill.methods.pruning.state`. A policy supplies
only the choice of tokens: a ``select``
callable over a score row (:mod:`~fastprefill.methods.pruning.select`) from a scorer
(:mod:`~fastprefill.methods.pruning.scorers`: what a token's importance is), a schedule
(:mod:`~fastprefill.methods.pruning.schedule`) and its scoring, protection and revival options
(:mod:`~fastprefill.methods.pruning.options`), or a fixed subset.
"""

from fastprefill.methods.pruning.decode import RevivalDecoder, decode_step, decode_steps
from fastprefill.methods.pruning.options import REVIVAL_POLICIES, PruneOptions, Revival
from fastprefill.methods.pruning.prefill import (
    PrunedPrefill,
    probe_scores,
    progressive_prefill,
    recording_kept_positions,
    subset_prefill,
)
from fastprefill.methods.pruning.schedule import (
    DepthSchedule,
    Schedule,
    check_depth_schedule,
    check_keep,
    check_layers,
    check_schedule,
    keep_count,
    resolve_depth_schedule,
    schedule_token_layers,
)
from fastprefill.methods.pruning.scorers import AttentionScorer, LogitScorer, RandomScorer, Scorer
from fastprefill.methods.pruning.select import SelectFn, avg_pool_scores, pool_in_position_order, top_k_keep
from fastprefill.methods.pruning.state import ComputeCounter, LazyState, new_state, rows_for, run_rows

__all__ = [
    "REVIVAL_POLICIES",
    "AttentionScorer",
    "ComputeCounter",
    "DepthSchedule",
    "LazyState",
    "LogitScorer",
    "PruneOptions",
    "PrunedPrefill",
    "RandomScorer",
    "Revival",
    "RevivalDecoder",
    "Schedule",
    "Scorer",
    "SelectFn",
    "avg_pool_scores",
    "check_depth_schedule",
    "check_keep",
    "check_layers",
    "check_schedule",
    "decode_step",
    "decode_steps",
    "keep_count",
    "new_state",
    "pool_in_position_order",
    "probe_scores",
    "progressive_prefill",
    "recording_kept_positions",
    "resolve_depth_schedule",
    "rows_for",
    "run_rows",
    "schedule_token_layers",
    "subset_prefill",
    "top_k_keep",
]
