"""What ``--precision fp8`` (``models.fp8``) costs and saves, as the planner prices it.

* **Compute**: the block's projections (``models.fp8.runs_in_fp8``: attention's q, k, v, o
  and the dense MLP's, 6 FLOPs per weight element per token in training) run at the
  device's float8 rate (``Device.float8_flops``); attention's core, the head and the rest
  at bf16's (fp8 computes in bf16 around its projections, ``choices.PRECISIONS``).
* **Communication**: FSDP's all-gathers move a projection weight's e4m3 bytes
  (``models.fp8.WEIGHT_BYTES``, cast where the weight is stored); each current scale is one
  more reduction: one scalar all-reduce of an amax over the batch axes, ``SCALE_REDUCTIONS``
  per layer (read off the compiled step). They are latency, not bytes.
* **Memory**: as bf16's (the activations are bf16; the e4m3 operands ``models.fp8`` saves for
  the backward are not modelled): ``--plan auto``'s compile has the last word.

The planner prices fp8 for a dense model trained in full (an MoE block's experts and a
LoRA base do not run through ``models.fp8``): ``fp8_reason``.

    >>> from triax.models import config
    >>> from triax.costs import hardware
    >>> from triax.costs.workload import Workload
    >>> w = Workload.of(config.get("llama3-8b"), train=True, dtype="fp8", batch=8, seq=4096)
    >>> h100 = hardware.cluster("h100-80gb", 8, 1).device
    >>> round(compute_factor(w, h100, 8 * 4096 * w.cfg.flops_per_token(4096)), 2)  # 2x on 80%
    0.59
"""
from __future__ import annotations

import math
from typing import Optional

from triax.choices import FP8
from triax.costs.hardware import Device
from triax.costs.param_layout import param_leaves
from triax.costs.workload import FP32, Workload
from triax.models import fp8

# Scalar all-reduces (one fp32 amax each) a layer adds to a training step under fp8,
# counted in the compiled step's executions: tiny (6 projections a layer) on data=8, dp and
# fsdp alike, 1 and 4 layers, 8 per layer (XLA combines some of a pass's amaxes).
SCALE_REDUCTIONS = 8


def fp8_reason(w: Workload) -> Optional[str]:
    """Why the planner does not price ``--precision fp8`` for ``w`` (None: it does)."""
    if w.cfg is None:
        return "fp8 needs a model (--model), not only --params"
    if not w.train:
        return "fp8 is a training precision (models.fp8's backward); serving runs bf16"
    if w.cfg.moe is not None:
        return "an MoE block's experts do not run in float8 (models.fp8 projects dense blocks)"
    if w.lora is not None:
        return "a LoRA base is frozen (bf16 or int8), not cast to float8"
    return None


def priced(w: Workload) -> bool:
    """Whether ``w`` runs in fp8 and the planner prices it so (``fp8_reason``); otherwise an
    fp8 workload is priced as bf16's."""
    return w.dtype == FP8 and fp8_reason(w) is None


def projection_elements(w: Workload) -> int:
    """Elements of the weights whose matmuls run in float8 (every layer's)."""
    return sum(math.prod(shape) for path, shape, _ in param_leaves(w.cfg)
               if fp8.runs_in_fp8(path))


def compute_factor(w: Workload, device: Device, flops: float) -> float:
    """The step's compute seconds under fp8 over the same step in bf16: the projections'
    ``6·elements·tokens`` of the step's ``flops`` at the float8 rate, the rest unchanged."""
    proj = min(flops, 6.0 * projection_elements(w) * w.batch * w.seq)
    return (flops - proj + proj * device.flops_bf16 / device.float8_flops) / flops


def gather_bytes(w: Workload, path: str) -> int:
    """Bytes per element FSDP's all-gather moves of the parameter at ``path``: the e4m3
    weight under fp8 where it is projected, else the compute dtype's."""
    return fp8.WEIGHT_BYTES if priced(w) and fp8.runs_in_fp8(path) else w.dtype_bytes


def scale_reductions(w: Workload, layers: int) -> int:
    """Scalar all-reduces of one step's current scales over the batch axes on a device
    running ``layers`` layers (``SCALE_REDUCTIONS`` each); 0 when not fp8."""
    return SCALE_REDUCTIONS * layers if priced(w) else 0


SCALE_BYTES = FP32   # one fp32 amax per reduction
