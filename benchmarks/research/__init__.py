"""Research harnesses behind the benchmark scripts, not part of the installed package: the
selection rules that chose LazyLLM's defaults (:mod:`.selection`), the selection ceiling
(:mod:`.ceiling`), the KV Prediction cache ablation (:mod:`.ablation`) and the kvp-prefix depth
sweep and predictor dev gate (:mod:`.kvp`). Imported as ``research.<module>``: the scripts run
with benchmarks/ on the path, and pytest puts it there (``pythonpath`` in pyproject.toml)."""
