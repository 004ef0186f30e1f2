"""One checkpoint layout, below training and inference.

A checkpoint directory holds one sub-directory per committed step, each with two items
(``triax.checkpoint.layout``):

    DIR/<step>/state   Orbax PyTreeSave of {"params": ..., "opt_state": ..., "step": ...}
                       (inference-only exports hold {"params": ...})
    DIR/<step>/meta    JSON: "model" (the ModelConfig), "checksums" (one per array of
                       state, checked on restore) and, from training, the run config,
                       data position, RNG, mesh and strategy
    DIR/<step>.corrupt a damaged step set aside by a resume (never deleted)

``Checkpointer`` (``triax.checkpoint.checkpointer``) writes and reads them; training adds its
resume policy (``triax.training.checkpoint``), inference its ``load_params``.
"""
from triax.checkpoint.checkpointer import Checkpointer, check_writable
from triax.checkpoint.integrity import CHECKSUMS, checksums
from triax.checkpoint.layout import (ITEMS, META, STATE, CheckpointError, CorruptCheckpoint,
                                     ModelMismatch, check_same_model, config_from_json,
                                     config_json, model_config_diff, model_from_meta,
                                     training_meta)

__all__ = ["CHECKSUMS", "Checkpointer", "CheckpointError", "CorruptCheckpoint", "ITEMS", "META",
           "ModelMismatch", "STATE", "check_same_model", "check_writable", "checksums",
           "config_from_json", "config_json", "model_config_diff", "model_from_meta",
           "training_meta"]
