"""What a :class:`~fastprefill.engine.Generation` hands those who drive it: each answer while it
decodes (:class:`Branch`, the rows a :class:`~fastprefill.batch.DecodeBatch` stacks) and a unit of
its prefill a layer at a time (:class:`LayeredUnit`, what a mixed batch runs beside decode rows).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from fastprefill.events import StreamEvent, TimingWindow
from fastprefill.methods.base import Decoder
from fastprefill.methods.layer_steps import LayerSteps

__all__ = ["Branch", "LayeredUnit"]


class Branch:
    """One of a generation's answers while it decodes: its :class:`~fastprefill.sampling.Choice`
    and its decode step over a cache of its own (answer 0 over the prefill's, the others over
    copies). A decode batch (:class:`~fastprefill.batch.DecodeBatch`) stacks branches as rows.

    Attributes:
        gen: the :class:`~fastprefill.engine.Generation` it belongs to; ``index`` which of its answers.
        decoder: its decode step (:class:`~fastprefill.methods.base.ModelDecoder` unless the
            method has its own); ``ragged``: its cache's layers hold different key sets.
        on_finish: called when the answer ends (a decode batch writes this row's K/V back).
    """

    def __init__(self, gen: Any, index: int, decoder: Decoder, ragged: bool) -> None:
        self.gen, self.index, self.decoder, self.ragged = gen, index, decoder, ragged
        self.choice = gen.choices[index]
        self.on_finish: Callable[[], None] | None = None

    @property
    def finished(self) -> bool:
        return self.choice.finish_reason is not None

    @property
    def last_token(self) -> int:
        """The token the next decode step feeds."""
        return self.choice.ids[-1]

    def step(self) -> StreamEvent:
        """One decode step alone: the next token's event."""
        with torch.inference_mode(), TimingWindow(self.gen.model.device) as window:
            self.choice.pick(self.decoder.step(self.last_token))  # (V,) logits -> the next token
        return self.gen.accept(self, window.seconds)


@dataclasses.dataclass
class LayeredUnit:
    """One unit of a generation's prefill a layer at a time (:meth:`Generation.prefill_steps`).

    Attributes:
        steps: the unit's rows, one group per decoder layer
            (:data:`~fastprefill.methods.layer_steps.LayerSteps`); returns the last row's ``(1, 1, D)``.
        finish: called with that row's ``(V,)`` float32 logits once the steps are done; ends the
            unit as :meth:`Generation.prefill` does and returns the prompt tokens it computed.
    """

    steps: LayerSteps
    finish: Callable[[torch.Tensor], int]
