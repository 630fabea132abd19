"""Tests on the real smollm2-135m, servers, child processes and torchrun ranks."""
