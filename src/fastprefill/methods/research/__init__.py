"""Research-only methods and policies, apart from the methods fastprefill serves.

Each is gated: a dev gate in ``benchmarks/`` decides whether it earns a place beside the served
methods, and until then no server offers it by default (:data:`fastprefill.serve.config.PER_REQUEST_METHODS`
does not name it).

- :mod:`~fastprefill.methods.research.blend`: ``blend``, cached passages' K/V reused at new
  positions with a share of their tokens recomputed (CacheBlend, EPIC);
- :mod:`~fastprefill.methods.research.fill`: the ``fill`` option of the pruning methods, a stand-in
  K/V row at later layers for a token pruned at a cut.
"""
