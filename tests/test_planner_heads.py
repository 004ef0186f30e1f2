"""Head counts that ``tensor`` does not divide: the planner asks the rules
(``Rules.local_size``), so it replicates what the compiled step replicates (KV heads) and
refuses what the rules refuse (query heads), never a third answer."""
import pytest

from triax.models import config
from triax.costs.comm import traffic
from triax.costs.activations import layer_activation_elements, tensor_local
from triax.costs.memory import estimate
from triax.planner.verify import compile_figures, run_config
from triax.costs.workload import Layout, Workload
from triax.sharding.rules import ShardingError


_CACHE = {}


def _compiled(w, lay):
    key = (w, lay)
    if key not in _CACHE:
        _CACHE[key] = compile_figures(w, lay)
    return _CACHE[key]


def _workload(cfg):
    return Workload.of(cfg, train=True, dtype="fp32", batch=16, seq=32, backend="cpu")


def test_query_heads_that_tensor_does_not_divide_are_refused_by_planner_and_compile(devices):
    from triax.training.setup import build_run
    cfg = config.get("tiny", num_layers=2).replace(num_heads=6)   # 6 heads, tensor 4
    w, lay = _workload(cfg), Layout(data=2, tensor=4, strategy="tp")
    with pytest.raises(ShardingError, match="'heads', size 6"):
        build_run(run_config(w, lay), w.cfg)
    with pytest.raises(ShardingError, match="size 6"):
        estimate(w, lay)
    with pytest.raises(ShardingError, match="size 6"):
        traffic(w, lay)
    # The activation term itself: it used to count the 6 heads whole on each rank.
    with pytest.raises(ShardingError, match="'act_heads', size 6"):
        layer_activation_elements(cfg, 32, 32, 4, "none")
    with pytest.raises(ShardingError):
        tensor_local("act_heads", 6, 4)


def test_kv_heads_that_tensor_does_not_divide_are_replicated_as_compiled(devices):
    cfg = config.get("tiny", num_layers=2)       # 2 KV heads, tensor 4: replicated
    assert tensor_local("act_kv_heads", cfg.num_kv_heads, 4) == cfg.num_kv_heads
    assert tensor_local("act_heads", cfg.num_heads, 4) == cfg.num_heads // 4
    w, lay = _workload(cfg), Layout(data=2, tensor=4, strategy="tp")
    got = _compiled(w, lay)
    assert estimate(w, lay).modelled == pytest.approx(got["memory"]["peak_bytes"], rel=0.15)


def test_kv_heads_replicated_traffic_matches_compile(devices):
    # Replicated KV heads: k's and v's input gradients are all-reduced at their own width
    # (planner 720,896 B over tensor, the compile 757,808; at the residual's, 917,504).
    cfg = config.get("tiny", num_layers=2)
    w, lay = _workload(cfg), Layout(data=2, tensor=4, strategy="tp")
    got = _compiled(w, lay)
    predicted = {a: t.payload for a, t in traffic(w, lay).items()}
    assert set(predicted) == set(got["collectives"])
    for axis, hlo_bytes in got["collectives"].items():
        assert predicted[axis] == pytest.approx(hlo_bytes, rel=0.10), axis
