"""The planner's decision rules, its CLI contract and its errors (no step compiles but the
planner's own op-cost probe, once per process: planner.op_costs)."""
import json
import re
import textwrap

import pytest

from triax.cli.main import main
from triax.mesh import make_mesh
from triax.models import config
from triax.pipeline import ScheduleError, ScheduleKind, build
from triax.pipeline.pipelined import Pipeline, PipelineConfig
from triax.costs import hardware
from triax.planner.recommend import plan
from triax.costs.memory import estimate, min_devices_for_weights
from triax.costs.pipeline_math import microbatch_constraint, peak_in_flight
from triax.sharding.partition import abstract_model
from triax.planner.search import layouts, long_sequence_loss_chunks, loss_chunks_keep_the_split
from triax.costs.workload import Layout, Workload


def _w(name, train, batch=8, seq=4096, **kw):
    return Workload.of(config.get(name), train=train, batch=batch, seq=seq, **kw)


def test_weights_bigger_than_a_device_never_get_one_device():
    w = _w("llama3-70b", train=False)
    h100 = hardware.cluster("h100-80gb", 8, 1)
    assert min_devices_for_weights(w, h100.device.memory) == 2
    for p in plan(w, h100, top=50).plans:
        assert p.layout.devices > 1 and p.fits
    with pytest.raises(ValueError, match="at least 2 h100-80gb"):
        plan(w, hardware.cluster("h100-80gb", 1, 1))


def test_70b_inference_on_one_nvlink_node_is_tp8():
    rec = plan(_w("llama3-70b", train=False), hardware.cluster("h100-80gb", 8, 1))
    best = rec.plans[0].layout
    assert (best.tensor, best.pipe, best.data) == (8, 1, 1)
    assert any("tensor parallelism" in s for s in rec.reasoning)


@pytest.mark.parametrize("name,train", [("llama3-8b", True), ("llama3-70b", False)])
def test_pcie_keeps_tp_at_most_two(name, train):
    rec = plan(_w(name, train, batch=64), hardware.cluster("h100-pcie", 8, 1))
    assert rec.plans[0].layout.tensor <= 2
    assert any("pcie5" in s for s in rec.reasoning)
    # The same job on NVLink is free to use wider TP (the rule is about the link).
    nv = plan(_w(name, train, batch=64), hardware.cluster("h100-80gb", 8, 1), top=100)
    assert any(p.layout.tensor > 2 for p in nv.plans)


@pytest.mark.parametrize("name,train,nodes", [("llama3-405b", False, 2),
                                              ("llama3-70b", True, 4)])
def test_bigger_than_a_node_pipelines_across_nodes(name, train, nodes):
    cluster = hardware.cluster("h100-80gb", 8, nodes)
    best = plan(_w(name, train, batch=64), cluster).plans[0].layout
    assert best.pipe > 1 and best.tensor <= 8
    assert best.pipe * best.data >= nodes        # pipe (with data) spans the nodes
    assert best.tensor * best.expert <= cluster.gpus_per_node


def test_moe_prefers_expert_parallelism_with_all_to_all():
    w = _w("mixtral-8x7b", train=False, batch=8)
    ep = estimate(w, Layout(expert=8, strategy="dp"))
    replicated = estimate(w, Layout(data=8, strategy="dp"))
    assert ep.params < replicated.params / 3          # experts split, attention replicated
    rec = plan(w, hardware.cluster("h100-80gb", 8, 1))
    best = rec.plans[0]
    assert best.layout.expert > 1
    assert "all-to-all" in best.traffic["expert"].payload_by_kind
    assert any("'expert' axis" in s for s in rec.reasoning)


def test_params_quick_estimate():
    w = Workload.of(None, params=7_000_000_000, train=True, dtype="bf16", batch=8, seq=2048)
    m = estimate(w, Layout(data=8, strategy="fsdp"))
    assert m.params == pytest.approx(7e9 * 4 / 8, rel=1e-6)       # fp32 master = params
    assert m.optimizer == pytest.approx(7e9 * 8 / 8, abs=64)       # mu and nu
    assert m.activations == 0


def _cli(capsys, *args):
    rc = main(["plan", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_json_contract(capsys):
    # test_pcie_keeps_tp_at_most_two's llama3-8b job: its pipelined plans' traces shared.
    rc, out, _ = _cli(capsys, "--model", "llama3-8b", "--train", "--gpu", "h100-80gb",
                      "--gpus-per-node", "8", "--nodes", "1", "--batch-size", "64",
                      "--seq-len", "4096", "--dtype", "bf16", "--top", "2", "--json")
    d = json.loads(out)
    assert rc == 0 and set(d) >= {"model", "min_devices_for_weights", "plans", "reasoning"}
    assert set(d["model"]) >= {"params", "weight_bytes"}
    p = d["plans"][0]
    assert set(p) >= {"mesh", "strategy", "schedule", "devices", "memory_per_device",
                      "comm_bytes_per_device", "comm_time_s", "compute_time_s",
                      "step_time_s", "mfu", "fits"}
    assert set(p["memory_per_device"]) >= {"params", "grads", "optimizer", "activations",
                                           "kv_cache", "total"}


def test_cli_explicit_plan_reports_overflow(capsys):
    rc, out, _ = _cli(capsys, "--model", "llama3-70b", "--train", "--gpu", "a100-40gb",
                      "--gpus-per-node", "8", "--nodes", "1", "--mesh", "tensor=8",
                      "--strategy", "tp", "--json")
    p = json.loads(out)["plans"][0]
    assert rc == 0 and p["fits"] is False and p["mesh"] == "tensor=8"
    assert "over by" in p["overflow"]


@pytest.mark.parametrize("args,msg", [
    (["--model", "llama3-8b", "--gpu", "h900"], "unknown GPU 'h900'"),
    (["--model", "llama9", "--gpu", "h100-80gb"], "unknown model 'llama9'"),
    (["--model", "llama3-405b", "--gpu", "h100-80gb", "--dtype", "bf16"], "at least 11 h100-80gb"),
    (["--model", "tiny", "--gpu", "h100-80gb", "--batch-size", "6", "--mesh", "data=8",
      "--strategy", "dp"], "batch size 6 does not divide over data=8"),
    (["--model", "tiny", "--gpu", "h100-80gb", "--batch-size", "16", "--mesh", "data=2,pipe=4",
      "--strategy", "dp", "--microbatches", "6"], "--microbatches 6 does not divide the 8"),
    (["--model", "tiny", "--gpu", "h100-80gb", "--batch-size", "16", "--mesh", "data=2,pipe=4",
      "--strategy", "dp", "--schedule", "interleaved", "--microbatches", "4"],
     "8 stage chunks but tiny has 4 layers"),
    (["--model", "tiny", "--gpu", "h100-80gb", "--mesh", "data=4", "--strategy", "dp"],
     "uses 4 devices but the cluster has 8"),
])
def test_cli_bad_input(capsys, args, msg):
    rc, _, err = _cli(capsys, *args, "--train", "--gpus-per-node", "8", "--nodes", "1")
    assert rc == 2 and msg in err and err.startswith("triax plan: error:")


def test_hardware_toml(tmp_path):
    f = tmp_path / "hw.toml"
    f.write_text('[devices.lab-gpu]\nmemory_gb = 32\nbf16_tflops = 100\nfp32_tflops = 20\n'
                 'hbm_gbps = 900\nform_factor = "pcie"\npcie = "pcie4"\n'
                 '[clusters.lab]\ngpu = "lab-gpu"\ngpus_per_node = 4\nnodes = 2\n')
    cat = hardware.load_catalog(f)
    c = cat.clusters["lab"]
    assert c.devices == 8 and c.intra.name == "pcie4" and c.device.memory == 32e9
    assert hardware.cluster("h100-80gb").intra.name == "nvlink4"
    assert hardware.cluster("l40s").intra.name == "pcie4"


def test_moe_training_ranks_pipelined_plans():
    """MoE pipelines (the expert all-to-all runs inside the stages): nothing is refused for
    it, and pipelined plans compete on their priced cost (pipe × expert ranks first here)."""
    w = _w("mixtral-8x7b", train=True, batch=64)
    rec = plan(w, hardware.cluster("h100-80gb", 8, 4), top=4)
    assert any(p.layout.pipe > 1 and p.layout.expert > 1 for p in rec.plans)
    assert not any("No pipeline stages" in r for r in rec.reasoning)
    # What the executor refuses for some meshes (experts over expert and the expert FFN
    # over tensor, inside a pipeline) is listed, not ranked.
    assert all("aborts XLA's SPMD partitioner" in r for r in rec.reasoning
               if r.startswith("Not runnable"))
    assert not any(p.layout.pipe > 1 and p.layout.expert > 1 and p.layout.tensor > 1
                   and "tp" in p.layout.strategy.name for p in rec.plans)


def test_schedule_constraints_are_the_generators():
    """1F1B with M < S runs (the generators build it); what they refuse, the planner
    refuses with their message."""
    assert build("1f1b", stages=4, microbatches=2).microbatches == 2
    assert microbatch_constraint(ScheduleKind.ONE_F_ONE_B, 4, 2) is None
    assert microbatch_constraint(ScheduleKind.ZB_H1, 4, 2) is None
    why = microbatch_constraint(ScheduleKind.INTERLEAVED, 4, 6, 2)
    assert why is not None and "divisible by stages" in why


def test_zb_v_is_searched_where_the_executor_runs_it():
    """The planner enumerates ZB-V with its two chunks per stage only where every chunk keeps
    a layer and the generator builds the table, and takes its peak from that table: 2S half-
    stage chunks, 1F1B's S whole-stage micro-batches."""
    w = Workload.of(config.get("tiny", num_layers=4), train=True, batch=16, seq=32)
    zbv = [lay for lay in layouts(w, hardware.cluster("h100-80gb", 8, 1))
           if lay.schedule is ScheduleKind.ZB_V]
    assert zbv and {(lay.pipe, lay.virtual) for lay in zbv} == {(2, 2)}   # pipe=4: 8 chunks
    assert all(microbatch_constraint(lay.schedule, lay.pipe, lay.microbatches, 2) is None
               for lay in zbv)
    for S, M in ((2, 4), (4, 8), (4, 32)):
        assert peak_in_flight(ScheduleKind.ZB_V, S, M, 2) == \
            peak_in_flight(ScheduleKind.ONE_F_ONE_B, S, M) == S


def test_searched_plans_are_what_the_executor_builds(devices):
    """Every pipelined plan the search yields passes the executor's own checks (its schedule
    table, the micro-batch split over data and expert; nothing is compiled); what the
    generators refuse is listed as not runnable with their reason, never ranked."""
    w = Workload.of(config.get("tiny-moe", num_layers=4), train=True, batch=12, seq=32)
    cluster = hardware.cluster("h100-80gb", 8, 1)
    refused, skipped = [], []
    plans = {(lay.sizes["data"], lay.pipe, lay.expert, lay.tensor, lay.strategy,
              lay.schedule, lay.microbatches, lay.virtual)
             for lay in layouts(w, cluster, refused, skipped) if lay.pipe > 1}
    assert plans and refused and skipped
    model = abstract_model(w.cfg)             # traced once: every Pipeline below shares it
    for data, pipe, expert, tensor, strategy, kind, m, v in sorted(plans, key=str):
        mesh = make_mesh(data=data, pipe=pipe, expert=expert, tensor=tensor)
        pp = Pipeline(model, mesh, strategy, PipelineConfig(kind.value, m, v))
        assert pp.schedule.microbatches == m
        pp._check_batch(w.batch, m)           # raises what the executor would raise
    for lay, why in refused:                  # the executor raises the planner's reason
        with pytest.raises(ScheduleError, match=re.escape(why)):
            Pipeline(model, make_mesh(**{a: n for a, n in lay.sizes.items() if n > 1}),
                     lay.strategy, PipelineConfig((lay.schedule or ScheduleKind.ONE_F_ONE_B)
                                                  .value, lay.microbatches, lay.virtual))
    rec = plan(w, cluster, top=50)
    assert any(r.startswith("Not runnable, so not ranked") for r in rec.reasoning)
    ranked = {(p.layout.pipe, p.layout.schedule, p.layout.microbatches) for p in rec.plans}
    assert not ranked & {(lay.pipe, lay.schedule, lay.microbatches) for lay, _ in refused}


def test_pipelined_moe_with_expert_and_tensor_still_aborts_xla(devices):
    """The reproducer behind ``unpipelinable_mesh_reason``: tiny-moe on pipe=2 × expert=2 ×
    tensor=2 with ``tp`` aborts XLA's SPMD partitioner (a subprocess: it kills the process).
    When this stops failing, XLA is fixed: lift the refusal. The executor refuses the mesh
    with the reason the planner lists."""
    import os
    import subprocess
    import sys
    script = textwrap.dedent("""
        import jax
        from triax.mesh import make_mesh
        from triax.models import config
        from triax.pipeline import pipelined
        from triax.pipeline.pipelined import PipelineConfig
        from triax.training.step import Trainer
        pipelined.experts_mesh_reason = lambda *a: None        # let it through
        t = Trainer(config.get("tiny-moe", num_layers=2), make_mesh(pipe=2, expert=2,
                    tensor=2), "tp", pipeline=PipelineConfig("1f1b", 2))
        t.lower(8, 16).compile()
        print("compiled")
    """)
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode != 0 and "compiled" not in proc.stdout
    assert "Check failed" in proc.stderr
    with pytest.raises(ScheduleError, match="aborts XLA's SPMD partitioner"):
        Pipeline(config.get("tiny-moe", num_layers=2), make_mesh(pipe=2, expert=2, tensor=2),
                 "tp", PipelineConfig("1f1b", 2))


def test_search_tries_context_where_the_sequence_splits():
    """Training searches context over the divisors that split the sequence for the zigzag
    layout (T divisible by 2·C), with both schemes, without pipeline stages; inference and
    an indivisible sequence get none."""
    cluster = hardware.cluster("h100-80gb", 8, 1)
    long = [lay for lay in layouts(_w("llama3-8b", True, batch=1, seq=32768), cluster)
            if lay.context > 1]
    assert {lay.context for lay in long} == {2, 4, 8}
    assert {lay.context_attention for lay in long} == {"all-gather", "ring"}
    assert all(lay.pipe == 1 for lay in long)
    odd = _w("llama3-8b", True, batch=1, seq=4 * 1001)      # 2·C divides it for C = 2 only
    assert {lay.context for lay in layouts(odd, cluster)} == {1, 2}
    assert {lay.context for lay in layouts(_w("llama3-8b", False, batch=1, seq=32768),
                                           cluster)} == {1}


def test_long_sequence_plans_context_parallelism_and_says_why():
    """One 262,144-token sequence on 32 GPUs: without the context axis only a pipeline of
    tensor-parallel stages fits (one micro-batch: 4× slower), the ring's plan fits and
    wins; the reasoning says both."""
    w = _w("llama3-8b", True, batch=1, seq=262144)
    rec = plan(w, hardware.cluster("h100-80gb", 8, 4))
    best = rec.plans[0]
    assert best.layout.context > 1 and best.layout.context_attention == "ring"
    why = " ".join(rec.reasoning)
    assert "Context parallelism: each 262,144-token sequence is split" in why
    assert "the best plan without it, pipe=4,tensor=8" in why and "% slower)" in why
    assert "context" in best.traffic


def test_131072_tokens_plan_context_parallelism_with_a_chunked_loss():
    """The issue's example (8 × 131,072 tokens, llama3-8b, 32 H100s): the whole sequence's
    fp32 logits keep every context plan over 80 GB (the smallest needed 87 GB), so the
    answer was TP × SP; computed over 16 slices they fit, and context wins on time over
    plain TP × SP. With collective matmul (issue 39) TP × SP's rings hide under its
    matmuls and its vocab-split logits need no chunked loss: it ranks first by < 1 %."""
    rec = plan(_w("llama3-8b", True, batch=8, seq=131072), hardware.cluster("h100-80gb", 8, 4))
    first = rec.plans[0]
    assert first.layout.tp_overlap and first.layout.tensor > 1 and first.fits
    best = next(p for p in rec.plans if not p.layout.tp_overlap)
    assert best.layout.context > 1 and best.workload.loss_chunks == 16 and best.fits
    assert best.step_time_s < 1.01 * first.step_time_s
    why = " ".join(rec.reasoning)
    assert "131,072 tokens is longer than llama3-8b's context (max_seq_len 8,192)" in why


def test_search_tries_a_chunked_loss_only_where_it_splits_evenly():
    assert [long_sequence_loss_chunks(t) for t in (2048, 8192, 16384, 131072, 12288)] == \
        [1, 1, 2, 16, 2]
    w = _w("llama3-8b", True, batch=8, seq=16384, loss_chunks=2)
    assert loss_chunks_keep_the_split(w, Layout(data=2, context=4, strategy="fsdp"))
    # Slices of 3 tokens cannot split over context=4: slicing would move data.
    w = _w("llama3-8b", True, batch=8, seq=24576, loss_chunks=8192)
    assert not loss_chunks_keep_the_split(w, Layout(data=2, context=4, strategy="fsdp"))


def test_cli_context_mesh(capsys):
    rc, out, _ = _cli(capsys, "--model", "llama3-8b", "--train", "--gpu", "h100-80gb",
                      "--gpus-per-node", "8", "--nodes", "4", "--seq-len", "131072",
                      "--mesh", "data=8,context=4", "--strategy", "fsdp", "--remat", "full",
                      "--context-attention", "ring", "--json")
    p = json.loads(out)["plans"][0]
    assert rc == 0 and p["mesh"] == "data=8,context=4"
    assert p["comm_payload_bytes_per_device"]["context"] > 0
    assert "--max-seq-len 131072 to lengthen" in " ".join(json.loads(out)["reasoning"])
    # --max-seq-len lengthens the model's context as `triax train` would: no note.
    rc, out, _ = _cli(capsys, "--model", "llama3-8b", "--train", "--gpu", "h100-80gb",
                      "--gpus-per-node", "8", "--nodes", "4", "--seq-len", "131072",
                      "--max-seq-len", "131072", "--mesh", "data=8,context=4", "--strategy",
                      "fsdp", "--remat", "full", "--context-attention", "ring", "--json")
    assert rc == 0 and "longer than" not in " ".join(json.loads(out)["reasoning"])


@pytest.mark.parametrize("args,msg", [
    (["--mesh", "data=2,pipe=2,context=2", "--seq-len", "1024"], "pipe × context is not modelled"),
    (["--mesh", "data=2,context=4", "--seq-len", "1004"], "divisible by 2·context = 8"),
    (["--mesh", "data=2,context=4", "--seq-len", "1024", "--inference"],
     "context parallelism for training only"),
])
def test_cli_context_mesh_refused(capsys, args, msg):
    job = [] if "--inference" in args else ["--train"]
    rc, _, err = _cli(capsys, "--model", "llama3-8b", "--gpu", "h100-80gb", "--strategy", "dp",
                      "--gpus-per-node", "8", "--nodes", "1", "--batch-size", "8", *job, *args)
    assert rc == 2 and msg in err, err
