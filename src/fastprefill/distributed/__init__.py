"""Processes and process groups: the low-level :mod:`.runtime` (threads, loopback port, group
init) and, above the engine, the local rank pool. Importing this package imports nothing else."""
