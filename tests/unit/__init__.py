"""Tests without a real model: random tiny models and pure logic."""
