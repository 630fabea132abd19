"""KV-Runahead (arXiv 2405.05329): parallel prefill along a chain of ranks, and the TSP baseline.

- :mod:`.method`: :class:`KVRunahead` and :class:`SequenceParallel` (the engine's methods);
- :mod:`.comm`: :class:`ChainComm`, the checked point-to-point messages of the chain;
- :mod:`.partition`: frozen :class:`PartitionPlan`, calibrated cost model, grid search, tables.

Processes are started by :mod:`fastprefill.launch` (one machine) or by ``torchrun``.
"""

from fastprefill.methods.runahead.comm import ChainComm, ChainCommError
from fastprefill.methods.runahead.method import KVRunahead, RunaheadState, SequenceParallel
from fastprefill.methods.runahead.partition import CostModel, PartitionPlan, PartitionTable, search_partition

__all__ = [
    "ChainComm",
    "ChainCommError",
    "CostModel",
    "KVRunahead",
    "PartitionPlan",
    "PartitionTable",
    "RunaheadState",
    "SequenceParallel",
    "search_partition",
]
