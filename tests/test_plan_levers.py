"""``--plan auto`` and the levers (issue 39): FP8 (``--allow-fp8``), HSDP (a replica axis when
the data axis crosses nodes) and ``--tp-overlap`` are each chosen where the planner prices
them faster, and each choice is proved by compile like every auto plan; where they do not
pay (or are not allowed) they are not chosen. The flags fix everything but the lever, so
each choice is one compile of a one-layer step on 8 simulated devices."""
import pytest

from triax.costs import hardware
from triax.costs.workload import Workload
from triax.planner import auto
from triax.training.config import RunConfig

GIB = 1 << 30
# As test_plan_auto's RUN (steps, data, ...): a choice of the same layout shares its compile.
BASE = dict(num_layers=1, batch_size=8, steps=3, plan="auto", data="markov",
            progress=False, eval_batches=0, remat="none", precision="bf16")
GIVEN = frozenset({"model", "num_layers", "batch_size", "seq_len", "steps", "plan", "remat",
                   "precision"})


def _choose(given=frozenset(), cluster=None, **kw):
    run = RunConfig(**{**BASE, **kw})
    return auto.choose_train(run, GIVEN | given, budget=auto.Budget(8 * GIB, "a test budget"),
                             cluster=cluster)


def _proved(c):
    assert c.compiled is not None and c.compiled.peak_bytes <= c.budget.usable
    return c


# ---- FP8: a candidate only with --allow-fp8, chosen where compute outweighs its scales -----
DP = dict(mesh="data=8", strategy="dp")
FIXED = frozenset({"mesh", "strategy"})


def test_fp8_is_chosen_where_the_projections_dominate_and_allowed():
    """small (D = 768), one layer, 32 × 1,024 tokens on data=8: the float8 projections save
    more than the per-tensor scales' all-reduces cost, so with --allow-fp8 fp8 is chosen
    (and its step compiled); without the opt-in no fp8 plan is ranked at all."""
    c = _proved(_choose(FIXED, model="small", batch_size=32, seq_len=1024, allow_fp8=True, **DP))
    assert c.run.precision == "fp8" and c.plan.workload.dtype == "fp8", auto.label(c.plan)
    assert "fp8" in auto.label(c.plan) and c.to_json()["precision"] == "fp8"
    w = Workload.of_run(c.run.replace(precision="bf16"), backend="cpu")
    cluster = auto.present_cluster()[0]
    plain = auto._searched(w, cluster, ("none",))        # what --plan auto ranks without it
    same = next(p for p in plain if p.layout == c.plan.layout)
    assert c.plan.step_time_s < same.step_time_s       # priced faster than bf16's
    assert {p.workload.dtype for p in plain} == {"bf16"}
    assert "fp8" in {p.workload.dtype for p in auto._searched(w, cluster, ("none",), ((),),
                                                               ("fp8",))}


def test_fp8_is_not_chosen_where_its_scales_cost_more():
    """tiny at 8 × 16 tokens: the step is latency, and fp8's scale all-reduces only add to
    it: allowed, fp8 is still not chosen, not even over fp32 (test_plan_auto's step)."""
    c = _proved(_choose(FIXED, model="tiny", seq_len=16, allow_fp8=True, precision="fp32",
                        **DP))
    assert c.run.precision == "fp32", auto.label(c.plan)


# ---- HSDP: a replica axis where the data axis crosses nodes ---------------------------------
TWO_NODES = (hardware.cluster("h100-80gb", 4, 2), "two made-up nodes of 4 h100-80gb")
# fp32: XLA's CPU compiler aborts on bf16 FSDP over data × context (AllReducePromotion),
# and the search puts context in both plans.
FP32 = dict(precision="fp32")


def test_hsdp_is_chosen_when_fsdp_crosses_nodes():
    """fsdp on two nodes of 4: gathering every weight over the inter-node link costs more
    than one replica group per node with only the gradient shard's all-reduce crossing."""
    c = _proved(_choose(frozenset({"strategy"}), model="tiny", seq_len=16, strategy="fsdp",
                        cluster=TWO_NODES, **FP32))
    assert c.plan.layout.replica == 2 and "replica=2" in c.run.mesh, auto.label(c.plan)


def test_hsdp_is_not_chosen_on_one_node():
    c = _proved(_choose(frozenset({"strategy"}), model="tiny", seq_len=16, strategy="fsdp",
                        **FP32))
    assert c.plan.layout.replica == 1 and "replica" not in c.run.mesh, auto.label(c.plan)


# ---- --tp-overlap: the rings hide under the matmuls once there are matmuls to hide under ----
TP = dict(mesh="data=4,tensor=2", strategy="tp_sp", **FP32)


@pytest.mark.parametrize("seq, overlap", [(1024, True), (16, False)])
def test_tp_overlap_is_chosen_where_the_rings_hide(seq, overlap):
    """tiny in fp32 on data=4 × tensor=2 tp_sp: at 8 × 1,024 tokens the permute rings hide
    under the matmuls and --tp-overlap is chosen (its collective-matmul step compiled); at
    8 × 16 there is nothing to hide under, and each permute's latency makes it slower."""
    c = _proved(_choose(FIXED | {"max_seq_len"}, model="tiny", seq_len=seq, max_seq_len=1024,
                        **TP))
    assert c.run.tp_overlap is overlap and c.plan.layout.tp_overlap is overlap, \
        auto.label(c.plan)


def test_fp8_prices_the_compiled_gathers_and_scale_reductions():
    """tiny fsdp on data=8, bf16 against fp8: the model's FSDP gathers shrink by the
    projections' elements (2 bytes to models.fp8.WEIGHT_BYTES' 1) exactly as the compiled
    step's do (there by 3 bytes each: XLA's CPU backend gathers bf16 as fp32), and its scale
    all-reduces are the compiled step's extra all-reduces, counted per execution."""
    from triax.costs.comm import traffic
    from triax.costs.workload import Layout
    from triax.models import config
    from triax.planner.verify import run_config
    from triax.sharding.introspect import collectives_from_compiled
    from triax.training.setup import build_run
    model, hlo = {}, {}
    for prec in ("bf16", "fp8"):
        w = Workload.of(config.get("tiny", num_layers=2), train=True, dtype=prec, batch=8,
                        seq=16, backend="cpu")
        lay = Layout(data=8, strategy="fsdp")
        t = traffic(w, lay)["data"]
        model[prec] = (t.payload_by_kind["all-gather"], t.messages_by_kind["all-reduce"])
        built = build_run(run_config(w, lay), w.cfg)
        cols = collectives_from_compiled(built.compiled.step, built.mesh)
        hlo[prec] = (sum(c.bytes_per_device * c.count for c in cols if c.kind == "all-gather"),
                     sum(c.count for c in cols if c.kind == "all-reduce"))
    assert model["bf16"][0] - model["fp8"][0] == (hlo["bf16"][0] - hlo["fp8"][0]) / 3 > 0
    assert model["fp8"][1] - model["bf16"][1] == hlo["fp8"][1] - hlo["bf16"][1] > 0
