"""KV-Runahead (arXiv 2405.05329): parallel prefill along a chain of ranks, and the TSP baseline.

- :mod:`.method`: :class:`KVRunahead` and :class:`SequenceParallel` (the engine's methods, both
  :class:`~fastprefill.methods.base.DistributedMethod`);
- :mod:`.comm`: :class:`ChainComm`, the checked point-to-point messages of the chain;
- :mod:`.plan`: the frozen :class:`PartitionPlan`;
- :mod:`.search`: the chain's :class:`CostModel` and the grid search;
- :mod:`.tables`: per-context-length :class:`PartitionTable` lookups (shipped in ``tables/``);
- :mod:`.calibrate`: fits the cost model on this machine and writes a table (a CLI).

Processes are started by the local rank pool (``fastprefill.distributed.pool``) or by
``torchrun`` (``python -m fastprefill.launch``); nothing here starts one.
"""

from fastprefill.methods.runahead.comm import ChainComm, ChainCommError
from fastprefill.methods.runahead.method import KVRunahead, SequenceParallel
from fastprefill.methods.runahead.plan import PartitionPlan, check_procs
from fastprefill.methods.runahead.search import CostModel, search_partition
from fastprefill.methods.runahead.tables import PartitionTable, find_table

__all__ = [
    "ChainComm",
    "ChainCommError",
    "CostModel",
    "KVRunahead",
    "PartitionPlan",
    "PartitionTable",
    "SequenceParallel",
    "check_procs",
    "find_table",
    "search_partition",
]
