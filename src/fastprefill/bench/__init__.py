"""The benchmark harness: records on disk (:mod:`.records`), paired summaries (:mod:`.summary`),
tables and plots (:mod:`.report`), the runner (:mod:`.runner`), selection rules
(:mod:`.selection`), the KV cache ablation (:mod:`.ablation`) and the check that committed
figures reproduce from their records (:mod:`.verify`)."""
