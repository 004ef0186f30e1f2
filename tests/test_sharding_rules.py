"""Rules, strategy presets and their shardings, asserted directly; every error's message."""
import jax
import pytest
from jax.sharding import PartitionSpec as P

from triax.mesh import make_mesh, parse_mesh
from triax.models import config
from triax.sharding import (STRATEGIES, Rules, ShardingError, Strategy, abstract_model,
                            param_shardings)
from triax.training.step import Trainer

AM = abstract_model(config.TINY)

EXPECTED = {  # strategy, mesh -> {param path: spec}
    ("dp", (8, 1)): {"blocks/attn/wq_DNH": P(), "embed/table_VD": P()},
    ("fsdp", (8, 1)): {"blocks/attn/wq_DNH": P(None, "data"),
                       "blocks/mlp/w_down_FD": P(None, None, "data"),
                       "embed/table_VD": P(None, "data"), "head_DV": P("data")},
    ("tp", (1, 8)): {"blocks/attn/wq_DNH": P(None, None, "tensor"),
                     "blocks/attn/wk_DKH": P(),  # 2 KV heads < 8 ranks: replicated
                     "blocks/attn/wo_NHD": P(None, "tensor"),
                     "blocks/mlp/w_in_D2F": P(None, None, None, "tensor"),
                     "blocks/mlp/w_down_FD": P(None, "tensor"),
                     "embed/table_VD": P("tensor"), "head_DV": P(None, "tensor")},
    ("tp", (4, 2)): {"blocks/attn/wk_DKH": P(None, None, "tensor")},  # 2 KV heads on 2 ranks
    ("fsdp_tp", (2, 4)): {"blocks/attn/wq_DNH": P(None, "data", "tensor"),
                          "blocks/mlp/w_down_FD": P(None, "tensor", "data")},
    ("zero1", (8, 1)): {"blocks/attn/wq_DNH": P()},
}


def flat_specs(shardings):
    from triax.sharding.partition import path_str
    return {path_str(p): s.spec for p, s in jax.tree_util.tree_flatten_with_path(shardings)[0]}


@pytest.mark.parametrize("strategy,shape", list(EXPECTED))
def test_preset_shardings(devices, strategy, shape):
    specs = flat_specs(param_shardings(AM, make_mesh(data=shape[0], tensor=shape[1]), strategy))
    for path, spec in EXPECTED[(strategy, shape)].items():
        assert specs[path] == spec, (path, specs[path], spec)


def test_zero1_shards_optimizer_rules_only(devices):
    mesh = make_mesh(data=8)
    opt = flat_specs(param_shardings(AM, mesh, "zero1", optimizer=True))
    assert opt["blocks/attn/wq_DNH"] == P(None, "data")
    trainer = Trainer(config.TINY.replace(num_layers=1), mesh, "zero1")
    mu = trainer.opt_shardings[1][0].mu
    assert mu["blocks"]["attn"]["wq_DNH"].spec == P(None, "data")


def test_strategies_are_hashable_and_steps_do_not_recompile(devices):
    assert len({hash(s) for s in STRATEGIES.values()}) == len(STRATEGIES)
    assert STRATEGIES["tp"] == Strategy("tp", STRATEGIES["tp"].rules, STRATEGIES["tp"].rules)
    trainer = Trainer(config.TINY.replace(num_layers=1), make_mesh(data=8), "dp")
    state = trainer.init(0)
    for i in range(2):
        state, _ = trainer.step(state, trainer.example_batch(8, 8, seed=i))
    assert trainer._jitted_step._cache_size() == 1


def test_not_divisible_names_param_dims_and_fix(devices):
    am = abstract_model(config.TINY.replace(num_heads=6, num_kv_heads=2))
    with pytest.raises(ShardingError) as e:
        param_shardings(am, make_mesh(data=2, tensor=4), "tp")
    msg = str(e.value)
    assert "blocks/attn/w" in msg and "'heads', size 6" in msg and "size 4" in msg
    assert "choose a mesh" in msg


def test_same_mesh_axis_twice():
    rules = Rules.of({"embed": "data", "mlp": "data"})
    with pytest.raises(ShardingError, match="mesh axis 'data' used twice.*'embed'.*'mlp'"):
        rules.spec(("embed", "mlp"), (8, 8), {"data": 2}, what="parameter 'w'")


def test_unknown_logical_name():
    with pytest.raises(ShardingError, match="unknown logical axis name.*'hiddn'"):
        Rules.of({"hiddn": "tensor"})
    with pytest.raises(ShardingError, match="unknown logical axis name 'hiddn'"):
        Rules.of({}).spec(("hiddn",))


def test_fsdp_leaving_large_params_replicated_is_refused(devices):
    lazy = Strategy("lazy_fsdp", Rules.of({"batch": "data"}), Rules.of({"batch": "data"}),
                    fsdp=True)
    with pytest.raises(ShardingError, match="fully replicated.*embed/table_VD.*'data'"):
        param_shardings(AM, make_mesh(data=8), lazy)


def test_unknown_strategy():
    from triax.sharding import get_strategy
    with pytest.raises(ShardingError, match="unknown strategy 'ddp'.*dp, fsdp"):
        get_strategy("ddp")


def test_mesh_product_mismatch_names_sizes_and_devices(devices):
    with pytest.raises(ValueError, match=r"data=3,tensor=2 multiplies to 6 .* JAX sees 8"):
        make_mesh(data=3, tensor=2)


def test_mesh_fill_and_axis_order(devices):
    mesh = make_mesh(tensor=2, data=-1)
    assert mesh.axis_names == ("replica", "data", "pipe", "expert", "context", "tensor")
    assert dict(zip(mesh.axis_names, mesh.devices.shape)) == {"replica": 1, "data": 4, "pipe": 1, "expert": 1, "context": 1,
                                                             "tensor": 2}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_hybrid_mesh_keeps_tensor_within_node(devices):
    from triax.mesh import make_hybrid_mesh
    mesh = make_hybrid_mesh(data=2, tensor=4, num_nodes=2)
    for row in mesh.devices.reshape(2, 4):  # each tensor group lies in one node of 4
        assert len({d.id // 4 for d in row}) == 1
    with pytest.raises(ValueError, match="tensor parallelism must stay within a node"):
        make_hybrid_mesh(tensor=8, num_nodes=2)


@pytest.mark.parametrize("text,err", [("data=2,tensr=4", "unknown mesh axis 'tensr'"),
                                      ("data2", "axis=size pairs"),
                                      ("data=x", "must be an integer"),
                                      ("data=2,data=4", "given twice")])
def test_parse_mesh_errors(text, err):
    with pytest.raises(ValueError, match=err):
        parse_mesh(text)


def test_parse_mesh_defaults():
    assert parse_mesh("data=2, pipe=2") == {"data": 2, "pipe": 2}


def test_strategy_kinds_are_the_named_strategies():
    # choices.py is the JAX-free home of the names (the CLI and RunConfig use it).
    from triax import choices
    from triax.sharding.rules import StrategyKind
    assert tuple(k.value for k in StrategyKind) == choices.STRATEGIES
    assert set(choices.FSDP_BASE) <= set(choices.STRATEGIES)
    assert set(choices.FSDP_BASE.values()) <= set(choices.STRATEGIES)


def test_remat_policies_are_the_named_policies():
    from triax import choices
    from triax.models.transformer import REMAT_POLICIES
    assert tuple(REMAT_POLICIES) == choices.REMAT_POLICIES
