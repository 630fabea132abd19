"""KV Prediction (Horton et al., arXiv 2410.08391): predict the base model's KV cache from a small
aux model's, so the base never runs the prompt.

- :mod:`.predictor`: :class:`KVPredictor`, the per-layer linear maps and the layer map;
- :mod:`.aux`: aux models (KVP-C: a smaller family member; KVP-LP: the base with layers dropped)
  and the tokenizer / weights checks;
- :mod:`.method`: :class:`KVPrediction`, the method (prefill / decode, load / save);
- :mod:`.checkpoint`: atomic checkpoint files;
- :mod:`.train`: :func:`train_kvp` (least-squares initialisation, then a short gradient phase).
"""

from fastprefill.methods.kv_prediction.aux import AuxSpec, TokenizerMismatchError, check_tokenizers
from fastprefill.methods.kv_prediction.checkpoint import CheckpointError
from fastprefill.methods.kv_prediction.method import AuxAlone, KVPrediction
from fastprefill.methods.kv_prediction.predictor import KVPredictor, default_layer_map, validate_layer_map
from fastprefill.methods.kv_prediction.prefix import KVPrefix

__all__ = [
    "AuxAlone",
    "AuxSpec",
    "CheckpointError",
    "KVPrediction",
    "KVPredictor",
    "KVPrefix",
    "TokenizerMismatchError",
    "check_tokenizers",
    "default_layer_map",
    "validate_layer_map",
]
