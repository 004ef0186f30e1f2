"""The frozen base costs what a frozen base costs, read in the compiled step: no
weight-gradient matmul for any base weight (plain and the ZB-H1 split backward), and the
optimizer state holds the adapters' AdamW moments only (``memory_analysis``)."""
import re

import jax
import numpy as np
import pytest

from triax.mesh import make_mesh
from triax.models import config, lora
from triax.models.config import LoraConfig
from triax.pipeline.pipelined import PipelineConfig
from triax.training.step import Trainer

BASE = config.TINY.replace(num_layers=2)
LORA = BASE.replace(lora=LoraConfig(rank=4))
# rows per (micro-)batch (8·12 = 96, 2·12 = 24) are no weight dimension, so a 2-D dot whose
# result has only weight dimensions is a weight gradient.
B, T = 8, 12
WEIGHT_DIMS = {BASE.embed_dim, BASE.num_heads * BASE.head_dim, BASE.num_kv_heads * BASE.head_dim,
               BASE.mlp_dim, 2 * BASE.mlp_dim, BASE.vocab_size}
LAYOUTS = {"plain": (dict(), None), "zb-h1": (dict(pipe=2), PipelineConfig("zb-h1"))}


def weight_grad_dots(hlo: str) -> int:
    shapes = re.findall(r"= f32\[([0-9,]*)\][^ ]* dot\(", hlo)
    return sum(1 for s in shapes if len(dims := [int(d) for d in s.split(",") if d]) == 2
               and set(dims) <= WEIGHT_DIMS)


@pytest.fixture(scope="module")
def compiled(devices):
    out = {}
    for name, (sizes, pipe) in LAYOUTS.items():
        n = int(np.prod(list(sizes.values()) or [1]))
        for cfg in (BASE, LORA):
            tr = Trainer(cfg, make_mesh(**sizes, devices=devices[:n]), "dp", pipeline=pipe)
            out[name, cfg.lora is not None] = (tr, tr.lower(B, T).compile())
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_no_weight_gradient_dots_for_the_base(compiled, layout):
    full = weight_grad_dots(compiled[layout, False][1].as_text())
    adapted = weight_grad_dots(compiled[layout, True][1].as_text())
    # Full fine-tuning: q, k, v, o, the fused gate|up and down per layer (the scanned body,
    # compiled once) and the head; LoRA: none (its adapters' gradients have a rank dim).
    assert full >= 7, full
    assert adapted == 0, adapted


def test_optimizer_state_is_the_adapters_moments(compiled):
    tr_full, c_full = compiled["plain", False]
    tr_lora, c_lora = compiled["plain", True]
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))  # noqa
    base = nbytes(tr_full.abstract.shapes)
    adapters = nbytes(lora.split(tr_lora.abstract.shapes)[0])
    assert adapters == 4 * lora.param_count(LORA.lora, LORA)
    opt = lambda tr: nbytes(jax.eval_shape(tr.fresh_state, tr.abstract.shapes)["opt_state"])  # noqa
    assert opt(tr_lora) == 2 * adapters + opt(tr_full) - 2 * base
    # The compiled step's arguments (state + batch): full FT holds base + 2 moments of it;
    # LoRA holds the base, the adapters and their 2 moments.
    arg_full = c_full.memory_analysis().argument_size_in_bytes
    arg_lora = c_lora.memory_analysis().argument_size_in_bytes
    assert arg_full - arg_lora == 2 * base - 3 * adapters, (arg_full, arg_lora)
