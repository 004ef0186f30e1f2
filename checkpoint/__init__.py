"""One checkpoint layout, below training and inference.

A checkpoint directory holds one sub-directory per committed step, each with two items
(``triax.checkpoint.layout``):

    DIR/<step>/state   Orbax StandardSave of {"params": ..., "opt_state": ..., "step": ...}
                       (inference-only exports hold {"params": ...})
    DIR/<step>/meta    JSON: "model" (the ModelConfig) and, from training, the run config,
                       data position, RNG, mesh and strategy

``Checkpointer`` (``triax.checkpoint.checkpointer``) writes and reads them; training adds its
resume policy (``triax.training.checkpoint``), inference its ``load_params``.
"""
from triax.checkpoint.checkpointer import Checkpointer
from triax.checkpoint.layout import (ITEMS, META, STATE, CheckpointError, ModelMismatch,
                                     check_same_model, config_from_json, config_json,
                                     model_config_diff, model_from_meta, training_meta)

__all__ = ["Checkpointer", "CheckpointError", "ITEMS", "META", "ModelMismatch", "STATE",
           "check_same_model", "config_from_json", "config_json", "model_config_diff",
           "model_from_meta", "training_meta"]
