"""A model's dimensions and the one FLOP cost model every method and benchmark uses.

Counting convention: 2 FLOPs per multiply-add. A layer's cost for ``R`` computed rows is its
linear maps on those rows plus ``QK^T`` and ``AV`` over the (query, key) pairs attended
(:meth:`ModelShape.layer_flops`); causal prefill of ``n`` rows attends ``n (n + 1) / 2`` pairs.
This module imports nothing from fastprefill: it sits at the bottom of the layering.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ModelShape", "causal_pairs"]


def causal_pairs(n: int) -> int:
    """(query, key) pairs of causal attention over ``n`` rows: ``n (n + 1) / 2``."""
    return n * (n + 1) // 2


@dataclass(frozen=True)
class ModelShape:
    """The dimensions a cost model or a KV map needs.

    Attributes:
        num_layers: decoder layers ``L``.
        hidden_size: ``D``.
        num_heads: query heads ``H_q``.
        num_kv_heads: key/value heads ``H_kv``.
        head_dim: ``d``.
        intermediate_size: MLP width.
        vocab_size: ``V``.
        max_positions: the context length the model was trained for.
    """

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_positions: int

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """Read the shape from a transformers config (the text config of a multimodal one)."""
        cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(
            num_layers=cfg.num_hidden_layers,
            hidden_size=cfg.hidden_size,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim=head_dim,
            intermediate_size=getattr(cfg, "intermediate_size", 4 * cfg.hidden_size),
            vocab_size=cfg.vocab_size,
            max_positions=getattr(cfg, "max_position_embeddings", 1 << 30),
        )

    def to_json(self) -> dict[str, int]:
        """The fields as a plain dict (checkpoint configs store it)."""
        return dict(vars(self))

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelShape:
        """Inverse of :meth:`to_json`."""
        return cls(**{k: int(v) for k, v in data.items()})

    # --- the cost model -----------------------------------------------------------------------
    def linear_flops_per_token(self) -> float:
        """FLOPs of one token through one layer's linear maps: q/k/v/o and a gated MLP (gate, up, down)."""
        d_q = self.num_heads * self.head_dim
        d_kv = self.num_kv_heads * self.head_dim
        attn = self.hidden_size * (d_q + 2 * d_kv) + d_q * self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        return 2.0 * (attn + mlp)

    def kv_flops_per_token(self) -> float:
        """FLOPs of one token through one layer's k and v projections."""
        return 4.0 * self.hidden_size * self.num_kv_heads * self.head_dim

    def qkv_share(self) -> float:
        """Fraction of :meth:`linear_flops_per_token` spent in the q/k/v projections."""
        d_q = self.num_heads * self.head_dim
        d_kv = self.num_kv_heads * self.head_dim
        return 2.0 * self.hidden_size * (d_q + 2 * d_kv) / self.linear_flops_per_token()

    def attention_flops(self, key_pairs: int) -> float:
        """FLOPs of ``QK^T`` and ``AV`` over ``key_pairs`` (query, key) dot products in one layer (all heads)."""
        return 4.0 * self.num_heads * self.head_dim * key_pairs

    def scoring_flops(self, keys: int) -> float:
        """FLOPs of one query's attention logits over ``keys`` keys (``QK^T`` only, all heads)."""
        return self.attention_flops(keys) / 2

    def layer_flops(self, rows: int, key_pairs: int | None = None) -> float:
        """FLOPs of one decoder layer computing ``rows`` rows that attend ``key_pairs`` pairs in all.

        ``key_pairs`` defaults to causal attention among the rows themselves
        (:func:`causal_pairs`), which is what a prefill over an empty layer cache does.
        """
        pairs = causal_pairs(rows) if key_pairs is None else key_pairs
        return self.linear_flops_per_token() * rows + self.attention_flops(pairs)

    def last_row_layer_flops(self, rows: int, keys: int) -> float:
        """FLOPs of a decoder layer that computes ``rows`` rows' keys and values but the rest for
        the last row only, which attends ``keys`` keys (a prefill's last layer when one position's
        logits are kept: :func:`fastprefill.models.fused.last_row_only`)."""
        return self.kv_flops_per_token() * (rows - 1) + self.linear_flops_per_token() + self.attention_flops(keys)

    def head_flops(self, n_tokens: int = 1) -> float:
        """FLOPs of the LM head for ``n_tokens`` rows."""
        return 2.0 * self.hidden_size * self.vocab_size * n_tokens

    def causal_prefill_flops(self, n_tokens: int) -> float:
        """FLOPs of a full causal prefill of ``n_tokens`` plus one LM-head row."""
        return self.num_layers * self.layer_flops(n_tokens) + self.head_flops(1)
