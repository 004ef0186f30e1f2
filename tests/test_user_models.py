"""Your model, sharded: a ViT and an MLP-Mixer that are not triax's own, through triax's rules,
strategies, pipeline, inspect and the compile check — each equal to its single-device self."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tree_checks import assert_trees_close
from flax import nnx
from layer_collectives import with_one_more_layer
from user_models import (MIXER_RULES, Mixer, MixerConfig, ViT, VitConfig, image_batch,
                         mixer_batch, mixer_loss, vit_loss)

import triax
from triax.mesh import make_mesh
from triax.pipeline.pipelined import PipelineConfig
from triax.sharding import ShardingError
from triax.sharding.introspect import placement_table

VIT = VitConfig(layers=2)
VIT_RULES = {"pixels": None, "classes": None}
MIXER = MixerConfig()
B = 8


def vit_trainer(mesh, strategy="dp", config=VIT, **kw):
    return triax.Trainer.for_model(lambda rngs: ViT(config, rngs), vit_loss, mesh, strategy,
                                   rules=VIT_RULES, **kw)


def mixer_trainer(mesh, strategy="dp", **kw):
    return triax.Trainer.for_model(lambda rngs: Mixer(MIXER, rngs), mixer_loss, mesh, strategy,
                                   rules=MIXER_RULES, **kw)


def with_grads(trainer_for, mesh, strategy="dp", **kw):
    """``trainer_for``'s Trainer whose step's metrics carry the gradients: one compile checks
    the loss and gradients (step 0's, at the initial parameters) and the 3 steps."""
    def loss_and_grad(params, batch):
        (loss, aux), grads = jax.value_and_grad(tr.loss_fn(), has_aux=True)(params, batch)
        return (loss, {**aux, "grads": grads}), grads
    tr = trainer_for(mesh, strategy, loss_and_grad=loss_and_grad, **kw)
    return tr


def run(trainer, init, batches, n_steps=3):
    """Loss and grads at the initial parameters, the losses of ``n_steps`` steps and the
    parameters after them: from the step's metrics for a ``with_grads`` trainer (one
    compile), else from ``Trainer.grads`` (``n_steps=0``: the pipelined ones). From
    ``init``, the one-device initial state on the host, placed (no init compile per mesh;
    test_sharded_init.py: each mesh's own init is the same state)."""
    if n_steps == 0:
        (loss, _), grads = trainer.grads(init["params"], batches[0])
        return float(loss), jax.device_get(grads), [], None
    state = trainer.place(init)
    metrics = []
    for b in batches[:n_steps]:
        state, m = trainer.step(state, b)
        metrics.append(jax.device_get(m))
    losses = [float(m["loss"]) for m in metrics]
    return losses[0], metrics[0]["grads"], losses, jax.device_get(state["params"])


def placed(trainer) -> dict:
    """Parameter path -> PartitionSpec entries, from the rules (no compile)."""
    return {r.path: r.spec
            for r in placement_table(trainer.abstract, trainer.mesh, trainer.strategy)}


def check_same(got, ref, what):
    loss, grads, losses, params = got
    np.testing.assert_allclose(loss, ref[0], rtol=1e-5, err_msg=f"{what} loss")
    assert_trees_close(grads, ref[1], rtol=1e-5, atol=1e-6, what=f"{what} grads")
    np.testing.assert_allclose(losses, ref[2], rtol=1e-5, err_msg=f"{what} losses")
    assert_trees_close(params, ref[3], rtol=1e-5, atol=1e-6, what=f"{what} params after 3 steps")


VIT_BATCHES = [image_batch(VIT, B, seed=i) for i in range(3)]
MIXER_BATCHES = [mixer_batch(MIXER, B, seed=i) for i in range(3)]


@pytest.fixture(scope="module")
def vit_one(devices):
    """The one-device ViT trainer (its step's metrics carry the gradients) and its initial
    state on the host, every ViT run's start."""
    tr = with_grads(vit_trainer, make_mesh(devices=devices[:1]))
    return tr, jax.device_get(tr.init(seed=0))


@pytest.fixture(scope="module")
def vit_init(vit_one):
    return vit_one[1]


@pytest.fixture(scope="module")
def vit_reference(vit_one):
    return run(*vit_one, VIT_BATCHES)


@pytest.fixture(scope="module")
def vit_sharded():
    """``with_grads`` ViT trainers by (strategy, data, tensor, layers), made once: a step the
    equality test compiled is the program the HLO, inspect and verify tests read."""
    made = {}

    def get(strategy, data, tensor, layers=VIT.layers):
        key = (strategy, data, tensor, layers)
        if key not in made:
            made[key] = with_grads(lambda mesh, st, **kw: vit_trainer(
                mesh, st, config=VitConfig(layers=layers), **kw),
                make_mesh(data=data, tensor=tensor), strategy)
        return made[key]
    return get


# The user's names go through each strategy's rules: tp (heads/mlp over tensor) and fsdp_tp
# (embed over data too). fsdp 8x1 is no case of its own: its one rule beyond dp, embed over
# data, is fsdp_tp's on the data axis of 2x4 (each strategy on every mesh:
# tests/test_equivalence.py). Nor is dp 8x1: its rules place none of the user's parameters
# (all replicated, the batch split over data): tp 1x8 runs replicated leaves (the norms,
# patch_CD, pos_PD and head_DK, whose axes tp leaves alone) and fsdp_tp 2x4 the batch split
# over data (data=2) with the gradients reduced over it.
@pytest.mark.parametrize("strategy,data,tensor", [("tp", 1, 8), ("fsdp_tp", 2, 4)])
def test_vit_strategy_matches_single_device(vit_reference, vit_init, vit_sharded, strategy, data,
                                            tensor):
    check_same(run(vit_sharded(strategy, data, tensor), vit_init, VIT_BATCHES), vit_reference,
               f"vit {strategy} ({data}x{tensor})")


def test_vit_parameters_are_placed_by_the_rules(devices):
    """fsdp_tp: `embed` over data, `heads`/`mlp` over tensor, the user's `pixels` replicated."""
    trainer = vit_trainer(make_mesh(data=2, tensor=4), "fsdp_tp")
    specs = placed(trainer)
    assert specs["blocks/qkv_D3NH"] == (None, "data", None, "tensor")
    assert specs["blocks/up/kernel"] == (None, "data", "tensor")
    assert specs["blocks/down/kernel"] == (None, "tensor", "data")
    assert specs["patch_CD"] == (None, "data")
    assert specs["head_DK"] == ("data",)


def test_mixer_with_its_own_names_matches_single_device(devices):
    one = with_grads(mixer_trainer, make_mesh(devices=devices[:1]))
    init = jax.device_get(one.init(seed=0))
    ref = run(one, init, MIXER_BATCHES)
    got = run(with_grads(mixer_trainer, make_mesh(data=2, tensor=4), "fsdp_tp"), init,
              MIXER_BATCHES)
    check_same(got, ref, "mixer fsdp_tp")


def test_mixer_channels_follow_embed(devices):
    """`channels: embed` shards the Mixer's channels like the preset's embed, per strategy."""
    mesh = make_mesh(data=8)
    dp, fsdp = placed(mixer_trainer(mesh, "dp")), placed(mixer_trainer(mesh, "fsdp"))
    assert dp["blocks/ch_in"] == () and dp["blocks/tok_in"] == ()
    assert fsdp["blocks/ch_in"] == (None, "data")
    assert fsdp["blocks/tok_in"] == (None, "data")
    assert fsdp["stem"] == (None, "data")        # patch: None (replicated) in MIXER_RULES


def test_vit_tp_all_reduce_per_row_parallel_matmul(vit_sharded):
    """Each block has two row-parallel matmuls (attention out, MLP down): one all-reduce over
    tensor each in the forward, and their transposes (qkv, MLP up input gradients) backward.
    The step is the tp 1x8 one test_vit_strategy_matches_single_device compiled (the
    gradients among its metrics are outputs, no collective); per block, its collectives with
    the layer scans run once more (``layer_collectives``)."""
    trainer = vit_sharded("tp", 1, 8)
    two, three = with_one_more_layer(trainer.lower(VIT_BATCHES[0]).compile(), trainer.mesh,
                                     layers=VIT.layers)
    tensor_all_reduces = [sum(c.count for c in cs if c.kind == "all-reduce" and "tensor" in c.axes)
                          for cs in (two, three)]
    assert tensor_all_reduces[1] - tensor_all_reduces[0] == 4


# The user's stack split into stages, with its forward and backward per stage (1f1b) and
# its backward split into input and weight gradients (zb-h1). GPipe is no case of its own:
# it runs 1f1b's stage forward and backward in another order (the schedules' orders:
# tests/test_pipeline_schedules.py).
@pytest.mark.parametrize("kind,M", [("1f1b", 4), ("zb-h1", 4)])
def test_vit_pipeline_matches_unpipelined(vit_reference, vit_init, kind, M):
    trainer = vit_trainer(make_mesh(data=2, pipe=2, tensor=2), "fsdp_tp",
                          pipeline=PipelineConfig(kind, M))
    loss, grads, _, _ = run(trainer, vit_init, VIT_BATCHES, n_steps=0)
    np.testing.assert_allclose(loss, vit_reference[0], rtol=1e-5)
    assert_trees_close(grads, vit_reference[1], rtol=1e-5, atol=1e-6, what=f"vit {kind} grads")


def test_inspect_reports_collectives_and_memory(vit_sharded):
    """Read from the fsdp_tp step test_vit_strategy_matches_single_device compiled (the
    figures are for any step; its metrics carry the gradients)."""
    report = triax.inspect(vit_sharded("fsdp_tp", 2, 4), VIT_BATCHES[0])
    kinds = {(c.kind, c.axes) for c in report.collectives}
    assert ("all-reduce", ("tensor",)) in kinds
    assert any(k == "all-gather" and "data" in axes for k, axes in kinds)   # FSDP gathers
    assert report.memory.peak_bytes > 0
    assert "blocks/qkv_D3NH" in report.to_text()


def test_verify_says_whether_it_fits(vit_sharded):
    trainer = vit_sharded("fsdp_tp", 2, 4)
    big = triax.verify(trainer, VIT_BATCHES[0], device_memory=2**40)
    small = triax.verify(trainer, VIT_BATCHES[0], device_memory=2**10)
    assert big["fits"] and not small["fits"]
    assert big["peak_bytes_per_device"] == small["peak_bytes_per_device"] > 0
    assert "does not fit" in small["verdict"]


# ---- bad input -----------------------------------------------------------------------------
def test_unknown_logical_name_lists_known_names_and_the_fix(devices):
    with pytest.raises(ShardingError, match=r"unknown logical axis name 'pixels'.*known names.*"
                                            r"embed.*rules=\{'pixels'"):
        triax.Trainer.for_model(lambda rngs: ViT(VIT, rngs), vit_loss, make_mesh(data=8), "dp",
                                rules={"classes": None})


def test_every_unknown_name_is_reported_at_once(devices):
    with pytest.raises(ShardingError, match=r"unknown logical axis names 'classes' \(in "
                                            r"parameter 'head_DK'\), 'pixels' \(in parameter "
                                            r"'patch_CD'\)"):
        triax.Trainer.for_model(lambda rngs: ViT(VIT, rngs), vit_loss, make_mesh(data=8), "dp")


def test_protocol_defines_the_loss_when_none_is_given(vit_init, vit_reference, devices):
    """loss_fn=None: head_loss over the stacked forward ÷ loss_weight, the pipeline's loss;
    against the user's own loss (vit_reference: its loss and grads at init(0), batch 0)."""
    mesh = make_mesh(devices=devices[:1])
    derived = triax.Trainer.for_model(lambda rngs: ViT(VIT, rngs), None, mesh, "dp",
                                      rules=VIT_RULES)
    (b, _), gb = derived.grads(vit_init["params"], VIT_BATCHES[0])     # the reference's init
    np.testing.assert_allclose(float(b), vit_reference[0], rtol=1e-6)
    assert_trees_close(gb, vit_reference[1], rtol=1e-5, atol=1e-7, what="protocol-loss grads")
    with pytest.raises(TypeError, match=r"lacks \['blocks', 'embed', 'block', 'head_loss'\]"):
        triax.Trainer.for_model(Unannotated, None, mesh, "dp", default="replicate")


def test_init_compiles_once_for_every_seed(vit_one):
    trainer = vit_one[0]                      # its init compiled for seed 0 already
    a, b = trainer.init(0)["params"], trainer.init(1)["params"]
    assert trainer._jitted_init._cache_size() == 1
    assert not np.allclose(np.asarray(a["patch_CD"]), np.asarray(b["patch_CD"]))


class Unannotated(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(4, 4, rngs=rngs)     # no logical names on kernel or bias

    def __call__(self, x):
        return self.lin(x)


def _sq_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2), {}


def test_parameter_without_names_is_an_error_or_replicated_on_request(devices):
    mesh = make_mesh(data=8)
    with pytest.raises(ShardingError, match=r"parameter 'lin/bias' \(4,\) has no logical axis "
                                            r"names.*with_partitioning.*default=\"replicate\""):
        triax.Trainer.for_model(Unannotated, _sq_loss, mesh, "dp")
    trainer = triax.Trainer.for_model(Unannotated, _sq_loss, mesh, "dp", default="replicate")
    batch = {"x": np.ones((8, 4), np.float32), "y": np.zeros((8, 4), np.float32)}
    state, metrics = trainer.step(trainer.init(0), batch)
    assert np.isfinite(float(metrics["loss"]))


def test_bad_rule_values_are_refused(devices):
    for rules, match in (({"pixels": "tensr"}, "neither a mesh axis"),
                         ({"pixels": ("data", "gpu")}, "not mesh axes")):
        with pytest.raises(ShardingError, match=match):
            vit_trainer(make_mesh(data=8), "dp").strategy.with_rules(rules)


def test_make_model_must_build_a_module(devices):
    with pytest.raises(ShardingError, match="must build an nnx.Module"):
        triax.Trainer.for_model(lambda rngs: {"w": 1}, _sq_loss, make_mesh(data=8), "dp")
