"""KV Prediction with an auxiliary model (Horton et al., arXiv 2410.08391; ``kvp``).

- :mod:`.models`: where the aux model comes from (KVP-C: a smaller family member; KVP-LP: the
  base with layers dropped) and the tokenizer / weights checks;
- :mod:`.predictor`: :class:`KVPredictor`, the per-layer linear maps and the layer map;
- :mod:`.method`: :class:`KVPrediction` (prefill, load / save) and :class:`AuxAlone`;
- :mod:`.fit`: the closed-form least-squares fit of the maps and their error measures;
- :mod:`.train`: :func:`train_kvp` (least-squares initialisation, then a short gradient phase).
"""

from fastprefill.methods.kv_prediction.auxiliary.method import AuxAlone, KVPrediction
from fastprefill.methods.kv_prediction.auxiliary.models import (
           AuxSpec,
           TokenizerMismatchError,
           check_tokenizers,
)
from fastprefill.methods.kv_prediction.auxiliary.predictor import (
           KVPredictor,
           default_layer_map,
           validate_layer_map,
)

__all__ = ["AuxAlone", "AuxSpec", "KVPrediction", "KVPredictor", "TokenizerMismatchError", "check_tokenizers",
           "default_layer_map", "validate_layer_map"]
