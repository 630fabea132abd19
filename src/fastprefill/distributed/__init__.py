"""Processes and process groups: the low-level :mod:`.runtime` (loopback port, group init) and,
above the engine, the rank pool (:mod:`.pool`), one rank's side (:mod:`.rank`) and torchrun's ranks
as a pool's ranks (:mod:`.torchrun_links`). Importing this package imports nothing else."""
