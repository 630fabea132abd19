"""Tests of the repository itself: import layers, docstrings, the README, committed figures, result names."""
