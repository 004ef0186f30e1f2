"""The model's math on one device: causality, GQA, tied embeddings, mesh-free construction."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from triax.mesh import make_mesh
from triax.models import Transformer, config
from triax.models.config import ModelConfig

CFG = config.TINY.replace(num_layers=2)


def test_causal_future_tokens_do_not_change_past_logits():
    model = Transformer(CFG, nnx.Rngs(0))
    a = jnp.array([[1, 2, 3, 4, 5, 6]], jnp.int32)
    b = a.at[0, 4:].set(jnp.array([9, 9]))
    la, _ = model(a)
    lb, _ = model(b)
    np.testing.assert_allclose(la[0, :4], lb[0, :4], rtol=1e-6, atol=1e-6)
    assert not np.allclose(la[0, 4:], lb[0, 4:])


def test_gqa_equals_mha_with_repeated_kv_weights():
    gqa_cfg = CFG.replace(num_kv_heads=2)
    mha_cfg = CFG.replace(num_kv_heads=8)
    gqa_graph, gqa = nnx.split(Transformer(gqa_cfg, nnx.Rngs(0)))
    gqa = nnx.to_pure_dict(gqa)
    attn = dict(gqa["blocks"]["attn"])
    for name in ("wk_DKH", "wv_DKH"):
        attn[name] = jnp.repeat(attn[name], 4, axis=2)  # kv head k serves query heads 4k..4k+3
    mha = {**gqa, "blocks": {**gqa["blocks"], "attn": attn}}
    mha_graph = nnx.graphdef(nnx.eval_shape(lambda: Transformer(mha_cfg, nnx.Rngs(0))))
    tokens = jnp.arange(12, dtype=jnp.int32).reshape(2, 6)
    out_gqa, _ = nnx.merge(gqa_graph, gqa)(tokens)
    out_mha, _ = nnx.merge(mha_graph, mha)(tokens)
    np.testing.assert_allclose(out_gqa, out_mha, rtol=1e-5, atol=1e-6)


def test_tied_embeddings_have_no_head():
    model = Transformer(CFG.replace(tie_embeddings=True), nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(model))
    assert "head_DV" not in params
    logits, _ = model(jnp.zeros((1, 4), jnp.int32))
    assert logits.shape == (1, 4, CFG.vocab_size)


def test_param_counts_match_the_tree():
    for cfg in (CFG, CFG.replace(tie_embeddings=True)):
        shapes = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))
        n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(shapes)))
        assert n == cfg.num_params


def test_llama_presets_have_published_sizes():
    assert round(config.LLAMA3_8B.num_params / 1e9, 2) == 8.03
    assert round(config.LLAMA3_70B.num_params / 1e9, 1) == 70.6
    assert round(config.LLAMA3_405B.num_params / 1e9, 0) == 406
    assert config.get("tiny", num_layers=3).num_layers == 3
    with pytest.raises(ValueError, match="unknown model 'llama9'.*tiny"):
        config.get("llama9")
    with pytest.raises(ValueError, match="num_heads=6 must be a multiple of num_kv_heads=4"):
        ModelConfig("bad", 16, 8, 1, 6, 4, 2, 8)


def test_construction_under_a_mesh_context_is_mesh_free(devices):
    """Flax's eager sharding would read logical names as mesh axes; triax turns it off per
    parameter, so building the model inside `jax.set_mesh` works and stays unsharded."""
    with jax.set_mesh(make_mesh(data=2, tensor=4)):
        model = Transformer(CFG, nnx.Rngs(0))
    logits, _ = model(jnp.zeros((2, 4), jnp.int32))
    assert logits.shape == (2, 4, CFG.vocab_size)


def test_models_package_names_no_mesh_axes():
    import pathlib
    import re
    root = pathlib.Path(__file__).resolve().parent.parent / "models"
    for f in root.glob("*.py"):
        text = f.read_text()
        assert not re.search(r"""["'](data|tensor|pipe|expert)["']""", text), f
        assert "PartitionSpec" not in text and "NamedSharding" not in text, f
