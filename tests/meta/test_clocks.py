"""Every timing of device work reads the one clock, :func:`fastprefill.host.device_clock`
(through :class:`fastprefill.events.TimingWindow` or directly), which synchronises the device
first: a ``time.perf_counter()`` read anywhere else in ``src/fastprefill`` must be in
:data:`OTHER_CLOCKS`, with the reason it times no queued device work."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "fastprefill"

#: Modules that read ``time.perf_counter`` themselves, and why that is honest on an accelerator.
OTHER_CLOCKS = {
    "host.py": "the clock itself: device_clock synchronises, then reads it",
    "serve/ranks.py": "the driver's clock around ranks' replies; each rank synchronised before it replied",
    "distributed/pool.py": "the driver's clock around ranks' replies; each rank synchronised before it replied",
    "distributed/loopback.py": "gloo send/recv of CPU tensors (the loopback's bandwidth)",
    "methods/kv_prediction/auxiliary/train.py": "a training run's wall seconds (a resumable budget), not a latency",
    "methods/kv_prediction/prefix/calibrate.py": "a calibration run's wall seconds, not a latency",
    "methods/kv_prediction/prefix/distill.py": "a distillation run's wall seconds, not a latency",
    "models/zoo.py": "a GGUF conversion's wall seconds",
    "cli/train_kvp.py": "a training command's wall seconds, printed",
    "cli/generate.py": "the rank pool's warm-up, around ranks' replies",
}


def _perf_counter_reads(path: Path) -> list[int]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr == "perf_counter"
            or isinstance(node, ast.alias) and node.name == "perf_counter"]


def test_every_other_clock_read_is_listed_with_its_reason():
    found = {str(p.relative_to(SRC)): lines for p in sorted(SRC.rglob("*.py")) if (lines := _perf_counter_reads(p))}
    unlisted = {name: lines for name, lines in found.items() if name not in OTHER_CLOCKS}
    assert not unlisted, f"time.perf_counter read outside fastprefill.host.device_clock: {unlisted}"
    assert set(OTHER_CLOCKS) <= set(found), f"listed but no longer reading it: {set(OTHER_CLOCKS) - set(found)}"
