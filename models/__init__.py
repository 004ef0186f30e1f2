"""Model math, written once. Logical axis names only: no mesh names live here."""
from triax.models import config, runtime
from triax.models.axes import constrain
from triax.models.config import ModelConfig, MoEConfig, RopeScaling
from triax.models.loss import cross_entropy, weighted_nll_sum
from triax.models.protocol import PipelineModel, run_stack, stack_loss
from triax.models.runtime import ExecConfig, Runtime
from triax.models.transformer import REMAT_POLICIES, Block, Transformer

__all__ = ["Block", "ExecConfig", "ModelConfig", "MoEConfig", "PipelineModel", "REMAT_POLICIES",
           "RopeScaling", "Runtime", "Transformer",
           "config", "constrain", "cross_entropy", "run_stack", "runtime", "stack_loss",
           "weighted_nll_sum"]
