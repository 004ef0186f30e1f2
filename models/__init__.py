"""Model math, written once. Logical axis names only: no mesh names live here."""
from triax.models import config
from triax.models.axes import constrain, using_constraint
from triax.models.config import ModelConfig, MoEConfig, RopeScaling
from triax.models.layers import ExecConfig
from triax.models.loss import cross_entropy, weighted_nll_sum
from triax.models.protocol import PipelineModel, run_stack, stack_loss
from triax.models.transformer import REMAT_POLICIES, Block, Transformer

__all__ = ["Block", "ExecConfig", "ModelConfig", "MoEConfig", "PipelineModel", "REMAT_POLICIES",
           "RopeScaling", "Transformer",
           "config", "constrain", "cross_entropy", "run_stack", "stack_loss", "using_constraint",
           "weighted_nll_sum"]
