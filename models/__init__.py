"""Model math, written once. Logical axis names only: no mesh names live here."""
from triax.models import config
from triax.models.axes import constrain, using_constraint
from triax.models.config import ModelConfig, MoEConfig
from triax.models.layers import ExecConfig
from triax.models.transformer import REMAT_POLICIES, Block, Transformer, cross_entropy, scan_blocks

__all__ = ["Block", "ExecConfig", "ModelConfig", "MoEConfig", "REMAT_POLICIES", "Transformer",
           "config", "constrain", "cross_entropy", "scan_blocks", "using_constraint"]
