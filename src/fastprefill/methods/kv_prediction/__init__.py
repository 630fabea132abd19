"""KV Prediction: predict the base model's KV cache instead of computing it, in two variants that
share their checkpoint files (:mod:`.checkpoint`) and calibration text (:mod:`.corpus`).

- :mod:`.auxiliary`: the paper's KV Prediction (Horton et al., arXiv 2410.08391): a small aux
  model reads the prompt and per-layer linear maps turn its KV into the base's, so the base never
  runs the prompt (``kvp``). ``models`` (KVP-C / KVP-LP aux models, tokenizer checks),
  ``predictor`` (:class:`KVPredictor`), ``method`` (:class:`KVPrediction`, :class:`AuxAlone`),
  ``train`` (least squares, then a short gradient phase).
- :mod:`.prefix`: kvp-prefix (SwiftKV-style, arXiv 2410.03960): the base's first layers run
  exactly and later layers' KV is predicted from their output (``kvp-prefix``). ``predictor``
  (:class:`PrefixPredictor`), ``method`` (:class:`KVPrefix`), ``calibrate`` (least squares),
  ``distill`` (KL distillation of the maps), ``distill_prompts`` (the dev prompts it uses).

The subpackage is ``auxiliary``, not ``aux``: ``aux`` is a reserved file name on Windows.
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
from fastprefill.methods.kv_prediction.checkpoint import CheckpointError
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
