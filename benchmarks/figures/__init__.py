"""The check that every committed figure reproduces from its records (run by verify.py beside
this package and by the test suite): result files against their committed summaries
(:mod:`.results`), the README's summary table (:mod:`.headline`) and the tables, paths, links and
commands of the README and docs/ (:mod:`.pages`). Imported as ``figures.<module>``, like
:mod:`research`."""
