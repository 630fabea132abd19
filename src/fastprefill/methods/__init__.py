"""Prefill methods, by family (each module's docstring is its reference):

- **The contract and the names**: :mod:`~fastprefill.methods.base` (``Method``,
  ``DistributedMethod``, what a prefill returns, and what a caller may ask a method: ``on_ranks``,
  ``served_name``, ``metric_label``), :mod:`~fastprefill.methods.registry` (method names and spec
  strings, ``make_method``), :mod:`~fastprefill.methods.auto` (the tuning profiles ``auto``
  serves), :mod:`~fastprefill.methods.layer_steps` (a decode step a layer at a time, for the
  methods that drive the layers themselves).
- **Served, exact**: :mod:`~fastprefill.methods.full` (plain prefill, the reference every figure is
  compared with); :mod:`~fastprefill.methods.runahead` (KV-Runahead and its baseline TSP: the
  prompt split over ranks).
- **Served, pruning**: :mod:`~fastprefill.methods.pruning` is the mechanism (the pruned prefill,
  revival while decoding, scorers, selection); :mod:`~fastprefill.methods.lazyllm` (LazyLLM) and
  :mod:`~fastprefill.methods.baselines` (random drop, static pruning, GemFilter) are its policies.
- **Served, predicted K/V**: :mod:`~fastprefill.methods.kv_prediction` (KV Prediction from an
  auxiliary model, ``kvp``; ``kvp-prefix``, the first layers exact and the rest predicted). They
  may read a checkpoint from the server's disk, so no request builds one: a server runs them
  when named at its start.
- **Research, gated, not served by default**: :mod:`~fastprefill.methods.research` (blending
  cached passages, the pruning methods' ``fill`` option).

Nothing is imported here: import a method from its module, or build one by name with
``fastprefill.make_method``.
"""
