"""Processes and process groups: the low-level :mod:`.runtime` (loopback port, group init) and,
above the engine, the rank pool (:mod:`.pool`), how its driver reaches a rank (:mod:`.links`: a
local worker process, a connection), one rank's side (:mod:`.rank`) and torchrun's ranks as a
pool's ranks (:mod:`.torchrun_links`). Importing this package imports nothing else."""
