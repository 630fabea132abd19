"""Research harnesses behind the benchmark scripts, not part of the installed package: the
selection rules that chose LazyLLM's defaults (:mod:`.selection`), the selection ceiling
(:mod:`.ceiling`), the KV Prediction cache ablation (:mod:`.ablation`), the kvp-prefix depth
sweep and predictor dev gate (:mod:`.kvp`) and which seams of a blended cache fail
(:mod:`.seams`). Imported as ``research.<module>``: the scripts run with benchmarks/ on the
path, and pytest puts it there (``pythonpath`` in pyproject.toml)."""
