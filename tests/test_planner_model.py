"""The planner's memory and communication model against XLA: abstract AOT compiles of the
real train step (no allocation) on the 8 simulated devices, compared with memory_analysis
and the HLO collectives (triax.sharding.introspect)."""
import pytest

from triax.models import config
from triax.pipeline import ScheduleKind
from triax.costs.comm import traffic
from triax.costs.memory import estimate
from triax.costs.pipeline_math import bubble_fraction, peak_in_flight, schedule_table
from triax.pipeline import build
from triax.pipeline.tick_program import compile_program
from triax.planner.verify import compile_figures
from triax.costs.workload import Layout, Workload

# model, layers, batch, seq, layout: few layers keep compiles short. One row per strategy
# and axis set (each row is a compile): small's fsdp and tp rows split the axes a tiny row
# of the same strategy would (tiny-fsdp on data=8, tiny-tp on 4x2 were the same paths), at
# sizes where the weights outweigh the fixed overheads.
CASES = {
    "tiny-dp": ("tiny", 2, 16, 32, Layout(data=8, strategy="dp")),
    "small-tp": ("small", 2, 8, 64, Layout(data=2, tensor=4, strategy="tp")),
    "small-fsdp": ("small", 2, 16, 64, Layout(data=8, strategy="fsdp")),
    # A pipelined step through triax.pipeline's executor.
    "tiny-pp": ("tiny", 4, 16, 32, Layout(data=2, pipe=4, strategy="dp",
                                          schedule=ScheduleKind.ONE_F_ONE_B, microbatches=8)),
    # The MoE layer: experts over `expert`, the expert FFN over `tensor`, the batch over
    # data (× expert, with the MoE rules).
    "tiny-moe-ep-tp": ("tiny-moe", 2, 16, 32, Layout(data=2, expert=2, tensor=2, strategy="tp")),
}


# Pipelined rows nothing in the planner was fitted on (the stash is derived from the
# executor's slot counts and traced residual shapes): their predicted peak must be within
# 10% of memory_analysis. (model, layers, batch, seq, layout, remat)
PIPELINE_CASES = {
    "tiny-pp-gpipe": ("tiny", 4, 16, 32, Layout(data=2, pipe=4, strategy="dp",
                                                schedule=ScheduleKind.GPIPE, microbatches=8),
                      "none"),
    "tiny-pp-zb-h1": ("tiny", 4, 16, 32, Layout(data=2, pipe=4, strategy="dp",
                                                schedule=ScheduleKind.ZB_H1, microbatches=8),
                      "none"),
    "tiny-pp-zb-v": ("tiny", 8, 16, 32, Layout(   # the V's chunks are routed from storage too
        data=2, pipe=4, strategy="dp", schedule=ScheduleKind.ZB_V, microbatches=8,
        virtual=2), "none"),
    "tiny-pp-interleaved": ("tiny", 8, 16, 32, Layout(
        data=2, pipe=4, strategy="dp", schedule=ScheduleKind.INTERLEAVED, microbatches=8,
        virtual=2), "none"),
    "tiny-pp-remat-full": ("tiny", 4, 16, 32, Layout(
        data=2, pipe=4, strategy="dp", schedule=ScheduleKind.ONE_F_ONE_B, microbatches=8),
        "full"),
    "tiny-pp-tp": ("tiny", 2, 16, 32, Layout(data=2, pipe=2, tensor=2, strategy="tp",
                                             schedule=ScheduleKind.ONE_F_ONE_B, microbatches=4),
                   "none"),
    # FSDP: the stage's weights are gathered whole once per step and its gradients
    # accumulated whole over data (0.833 while one block's gather was counted).
    # Two layers per stage too: each op's layer loop materialises a residual set and B's
    # whole chunk gradient (without the loop's residual set this row is at 0.857; the dp row
    # of 8 layers over pipe=4 it replaced was at 0.882, 0.898 before both were counted).
    "tiny-pp-fsdp": ("tiny", 4, 16, 32, Layout(data=4, pipe=2, strategy="fsdp",
                                               schedule=ScheduleKind.ONE_F_ONE_B,
                                               microbatches=4), "none"),
}


@pytest.mark.parametrize("key", list(PIPELINE_CASES))
def test_pipeline_memory_and_comm_are_derived_not_fitted(devices, key):
    name, layers, B, T, lay, remat = PIPELINE_CASES[key]
    w = Workload.of(config.get(name, num_layers=layers), train=True, dtype="fp32", batch=B,
                    seq=T, remat=remat, backend="cpu")   # the kernel the CPU compile runs
    got = compile_figures(w, lay)
    assert estimate(w, lay).modelled == pytest.approx(got["memory"]["peak_bytes"], rel=0.10)
    # Communication too (interleaved: the chunk moves between storage and compute stages).
    predicted = {a: t.payload for a, t in traffic(w, lay).items()}
    for axis, hlo_bytes in got["collectives"].items():
        assert predicted[axis] == pytest.approx(hlo_bytes, rel=0.10), axis


# Uneven stages: (layers, data, pipe, counts). Compiled over modelled peak:
UNEVEN_CASES = {
    # 0.994 (1.066 without the layer slot's conditional, pipeline.buffer_sizes' ``slot``
    # and its gradient; 1.0999 while the stack was kept whole on every pipe rank).
    "tiny-3-1": (4, 4, 2, (3, 1)),
    # 0.971 (1.049 without the slot's terms; 1.18 while the executor stacked per-stage
    # concatenations, which XLA built as one replicated [S, Lc] copy per stage).
    "tiny-2-1-2-1": (6, 2, 4, (2, 1, 2, 1)),
}
# Tighter than the pipelined rows' 10%: without the slot's terms both rows fail it.
UNEVEN_REL = 0.04


@pytest.mark.parametrize("key", list(UNEVEN_CASES))
def test_uneven_stage_memory_matches_compile(devices, key):
    """The peak within 4% (the pipelined rows' 10% with margin). The data-axis traffic is
    not checked: the model predicts 2.3x the HLO's for uneven stages (not fixed)."""
    layers, data, pipe, counts = UNEVEN_CASES[key]
    w = Workload.of(config.get("tiny", num_layers=layers), train=True, dtype="fp32",
                    batch=16, seq=32, backend="cpu")
    lay = Layout(data=data, pipe=pipe, strategy="dp", schedule=ScheduleKind.ONE_F_ONE_B,
                 microbatches=4, stage_layers=counts)
    got = compile_figures(w, lay)
    assert estimate(w, lay).modelled == pytest.approx(got["memory"]["peak_bytes"],
                                                      rel=UNEVEN_REL)


@pytest.fixture(scope="module")
def compiled(devices):
    out = {}
    for key, (name, layers, B, T, lay) in CASES.items():
        w = Workload.of(config.get(name, num_layers=layers), train=True, dtype="fp32",
                        batch=B, seq=T, backend="cpu")
        out[key] = (w, lay, compile_figures(w, lay))
    return out


@pytest.mark.parametrize("key", list(CASES))
def test_memory_terms_match_memory_analysis(compiled, key):
    w, lay, got = compiled[key]
    mem = estimate(w, lay)
    batch_bytes = 2 * (w.batch // lay.batch_shards) * w.seq * 4
    state = got["memory"]["argument_bytes"] - batch_bytes     # params + optimizer state
    assert mem.params + mem.optimizer == pytest.approx(state, rel=0.02)
    assert mem.modelled == pytest.approx(got["memory"]["peak_bytes"], rel=0.15)


@pytest.mark.parametrize("key", list(CASES))
def test_comm_bytes_match_hlo(compiled, key):
    w, lay, got = compiled[key]
    predicted = {a: t.payload for a, t in traffic(w, lay).items()}
    assert set(predicted) == set(got["collectives"])
    for axis, hlo_bytes in got["collectives"].items():
        assert predicted[axis] == pytest.approx(hlo_bytes, rel=0.10), axis


def test_pipe_traffic_follows_schedule():
    # The formula against the schedule, not a compile: each micro-batch's activation
    # crosses each boundary forward and its gradient backward (with the pipeline's table: a
    # permute per tick each way), and the stage-shared parameters' gradients are
    # all-reduced over pipe once.
    cfg = config.get("tiny", num_layers=4)
    w = Workload.of(cfg, train=True, dtype="fp32", batch=16, seq=32, backend="cpu")
    for M in (4, 8):
        lay = Layout(data=2, pipe=4, strategy="dp", schedule=ScheduleKind.ONE_F_ONE_B,
                     microbatches=M)
        t = traffic(w, lay)["pipe"]
        table = schedule_table(ScheduleKind.ONE_F_ONE_B, 4, M)
        sends = 2 * (table.ticks if table is not None else M)
        per_mb = (16 // 2 // M) * 32 * cfg.embed_dim * 4
        shared = (2 * cfg.vocab_size * cfg.embed_dim + cfg.embed_dim) * 4
        assert t.payload_by_kind["collective-permute"] == pytest.approx(sends * per_mb)
        assert t.payload_by_kind["all-reduce"] == shared
        assert traffic(w, lay)["data"].payload == estimate(w, lay).params  # grads once
    assert bubble_fraction(ScheduleKind.ONE_F_ONE_B, 4, 12) == pytest.approx(3 / 15)
    assert bubble_fraction(ScheduleKind.INTERLEAVED, 4, 8, 2) == pytest.approx(3 / 19)
    assert peak_in_flight(ScheduleKind.GPIPE, 4, 16) == 16
    assert peak_in_flight(ScheduleKind.ONE_F_ONE_B, 4, 16) == 4


def test_gpipe_holds_more_activations_than_1f1b():
    # The pipelined rows' tiny workload (its one traced chunk shape: one layer, one row per
    # micro-batch), at 16 micro-batches per replica.
    w = Workload.of(config.get("tiny", num_layers=4), train=True, dtype="fp32", batch=32,
                    seq=32, backend="cpu")
    g = estimate(w, Layout(data=2, pipe=4, schedule=ScheduleKind.GPIPE, microbatches=16))
    f = estimate(w, Layout(data=2, pipe=4, schedule=ScheduleKind.ONE_F_ONE_B, microbatches=16))
    # GPipe stashes all M=16 micro-batches, 1F1B at most S=4 (the executor's slot counts).
    # The executor's buffers add one scratch slot and two op buffers to either stash
    # (executor.slot_buffer_bytes): 19 residual sets against 7, so more than 2.5x, not 4x.
    assert compile_program(build("gpipe", 4, 16)).stash_slots == 16
    assert compile_program(build("1f1b", 4, 16)).stash_slots == 4
    assert g.activations > 2.5 * f.activations
    assert g.params == f.params and g.optimizer == f.optimizer


# Context parallelism, rows nothing was fitted on (the one fitted attention figure, the
# softmax backward's score array, came from whole-sequence rows: models.attention_memory).
# (model, layers, batch, seq, layout); tiny's max_seq_len is raised to the row's seq.
CONTEXT_CASES = {
    "tiny-cp4-all-gather": ("tiny", 2, 4, 256, Layout(data=2, context=4, strategy="dp")),
    # FSDP: the table gathered for the lookup, the gradients at their split sizes.
    "tiny-cp4-fsdp": ("tiny", 2, 4, 512, Layout(data=2, context=4, strategy="fsdp")),
    # ZeRO-1: the gradients all-reduced over context at the optimizer's sharding.
    "tiny-cp2-zero1": ("tiny", 2, 8, 512, Layout(data=4, context=2, strategy="zero1")),
}
# The flash-style custom-VJP ring (sharding/ring.py: saves q, its K/V block, o and the
# log-sum-exp; dK/dV travel with their blocks in the backward), at a long local block: at
# short ones (64-256 local queries) the planner's four transient score tiles overstate what
# XLA keeps by 22-36% (bench/planner_verify.py's ring rows).
RING_CASES = {
    "tiny-cp4-ring": ("tiny", 2, 4, 4096, Layout(data=2, context=4, strategy="dp",
                                                context_attention="ring")),
}


def _context_row(case):
    name, layers, B, T, lay = case
    cfg = config.get(name, num_layers=layers)
    w = Workload.of(cfg.replace(max_seq_len=max(cfg.max_seq_len, T)), train=True,
                    dtype="fp32", batch=B, seq=T, backend="cpu")
    return w, lay, compile_figures(w, lay)


def _check_context_row(w, lay, got):
    assert estimate(w, lay).modelled / got["memory"]["peak_bytes"] == \
        pytest.approx(1.0, abs=0.10)
    predicted = {a: t.payload for a, t in traffic(w, lay).items()}
    assert set(predicted) == set(got["collectives"])
    assert predicted["context"] == pytest.approx(got["collectives"]["context"], rel=0.02)
    for axis, hlo_bytes in got["collectives"].items():
        assert predicted[axis] == pytest.approx(hlo_bytes, rel=0.10), axis


@pytest.mark.parametrize("key", list(CONTEXT_CASES))
def test_context_parallel_memory_and_bytes_match_compiled(devices, key):
    _check_context_row(*_context_row(CONTEXT_CASES[key]))


@pytest.mark.parametrize("key", list(RING_CASES))
def test_ring_memory_and_bytes_match_compiled(devices, key):
    _check_context_row(*_context_row(RING_CASES[key]))


def test_context_traffic_follows_the_scheme():
    # The formula against the schemes, not a compile: per layer, the all-gather scheme
    # gathers K and V forward and reduce-scatters their gradients backward (T·K·H each),
    # the keys' order gathered once per step; the ring passes the stacked K/V block
    # ((T/C)·K·H each) and its keys' order C−1 times forward and again backward, with the
    # block's dK/dV, which takes one more hop home; full remat reruns the forward's; every
    # gradient is all-reduced over context (dp: the whole fp32 parameters).
    cfg = config.get("tiny", num_layers=3)
    B, T, C, L = 4, 256, 4, 3
    rows = B // 2
    kv = rows * cfg.num_kv_heads * cfg.head_dim * 4          # one K (or V) row of T, fp32
    for remat, again in (("none", 1), ("full", 2)):
        w = Workload.of(cfg, train=True, dtype="fp32", batch=B, seq=T, remat=remat)
        ag = traffic(w, Layout(data=2, context=C))["context"].payload_by_kind
        assert ag["all-gather"] == L * 2 * again * T * kv + rows * T * 4
        assert ag["reduce-scatter"] == L * 2 * T * kv
        assert ag["all-reduce"] == estimate(w, Layout(data=2, context=C)).params
        ring = traffic(w, Layout(data=2, context=C, context_attention="ring"))["context"]
        block, order = 2 * T // C * kv, rows * T // C * 4
        hops = (C - 1) * (again + 1)
        assert ring.payload_by_kind["collective-permute"] == \
            L * (hops * (block + order) + C * block)


def test_chunked_loss_saving_matches_compiled(devices):
    # llama3-1b's 128,256-entry vocabulary on one layer, the sequence over context=4: 8,192
    # tokens per device, so the fp32 logits (4.2 GB, three times over) set the peak. The
    # planner's peak at --loss-chunks 8 over its peak at 1 must be the compiled ratio (the
    # totals share the base error of these multi-sequence ring rows, 1.19 at 1 chunk).
    cfg = config.get("llama3-1b", num_layers=1)
    lay = Layout(data=2, context=4, strategy="fsdp", context_attention="ring")
    peaks = {}
    for chunks in (1, 8):
        w = Workload.of(cfg, train=True, dtype="fp32", batch=8, seq=8192, backend="cpu",
                        loss_chunks=chunks)
        peaks[chunks] = (estimate(w, lay).modelled,
                         compile_figures(w, lay)["memory"]["peak_bytes"])
    predicted, compiled = (peaks[8][i] / peaks[1][i] for i in (0, 1))
    assert compiled < 0.6, compiled                 # the saving is real: 18.7 -> 10.2 GB
    assert predicted == pytest.approx(compiled, rel=0.05)
