"""The benchmark harness behind ``fastprefill bench`` and ``fastprefill tune``: records on disk
(:mod:`.records`), paired summaries (:mod:`.summary`), tables and plots (:mod:`.report`) and the
runner (:mod:`.runner`). The research harnesses (selection rules, the selection ceiling, the KV
cache ablation, the KV Prediction sweeps) and the check that committed figures reproduce from
their records need a repository checkout and live beside the scripts: benchmarks/research/ and
benchmarks/figures/."""
