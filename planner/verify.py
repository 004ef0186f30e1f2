"""``--verify``: compile a plan ahead of time on simulated CPU devices and set the compiled
figures beside the predicted ones.

The step is lowered on abstract inputs (``Trainer.lower``: ShapeDtypeStructs, nothing is
allocated) and compiled; ``memory_analysis`` gives per-device bytes and the HLO gives the
collectives (``triax.sharding.introspect``). JAX fixes its device count at start-up, so a
plan needing another count runs in a subprocess with ``JAX_NUM_CPU_DEVICES`` set.

    >>> from triax.models import config
    >>> from triax.costs.workload import Layout, Workload
    >>> w = Workload.of(config.get("tiny", num_layers=2), train=True, dtype="fp32",
    ...                 batch=8, seq=16)
    >>> row = verify(w, Layout(data=8))          # doctest: +SKIP
    >>> row["memory"]["compiled"] > 0           # doctest: +SKIP
    True
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from typing import Optional

from triax.models import config
from triax.costs.comm import traffic
from triax.costs.hardware import load_catalog
from triax.costs.memory import estimate
from triax.pipeline import ScheduleKind
from triax.costs.workload import Layout, Workload
from triax.training.config import PRECISIONS, RunConfig
from triax.units import human_bytes

# JAX is imported only inside compile_figures: `triax plan --verify` must not start JAX in
# its own process when the plan needs another device count (that compile runs in a
# subprocess with JAX_NUM_CPU_DEVICES set; see _in_process_or_subprocess).


def layout_fields(w: Workload, lay: Layout) -> dict:
    """The ``RunConfig`` fields that say how a plan is laid out and run (mesh, strategy,
    schedule, micro-batches, chunks, remat, loss chunks, context scheme, host offload,
    precision): what
    ``--plan auto`` fills in and ``run_config`` builds with."""
    return dict(mesh=lay.mesh_str, offload=",".join(lay.offload), precision=w.dtype,
                strategy=lay.strategy.name, remat=w.remat, loss_chunks=w.loss_chunks,
                context_attention=lay.context_attention, tp_overlap=lay.tp_overlap,
                schedule=(lay.schedule or ScheduleKind.ONE_F_ONE_B).value,
                microbatches=lay.microbatches, virtual=lay.virtual)


LAYOUT_FIELDS = tuple(layout_fields(Workload(None, 1, True), Layout()))


def run_config(w: Workload, lay: Layout) -> RunConfig:
    """The plan as a training run (what ``compile_figures`` builds through ``build_run``)."""
    if w.dtype not in PRECISIONS:
        raise ValueError(f"dtype {w.dtype!r}: choose one of {', '.join(PRECISIONS)}")
    return RunConfig.of(model=w.cfg.name, num_layers=w.cfg.num_layers, batch_size=w.batch,
                        seq_len=w.seq, attention=w.attention,
                        pipeline_fsdp=lay.pipeline_fsdp, **layout_fields(w, lay),
                        stage_layers=lay.stage_layers and ",".join(map(str, lay.stage_layers)),
                        **_lora_fields(w))


def _lora_fields(w: Workload) -> dict:
    """The run's ``--lora-*`` / ``--base-dtype`` for a LoRA workload."""
    lo = w.lora
    return {} if lo is None else dict(lora_rank=lo.rank, lora_alpha=lo.alpha,
                                      lora_targets=",".join(lo.targets),
                                      base_dtype=lo.base_dtype)


def compile_figures(w: Workload, lay: Layout) -> dict:
    """Compile the plan's train step in this process (needs exactly ``lay.devices`` JAX
    devices) and return {"memory": MemoryReport json, "collectives": {axis: payload}}."""
    import jax  # see the note at the imports
    from triax.training.setup import build_run

    if len(jax.devices()) != lay.devices:
        raise ValueError(f"plan needs {lay.devices} devices, JAX has {len(jax.devices())}; "
                         f"use verify() (it starts a subprocess with the right count)")
    run = build_run(run_config(w, lay), w.cfg)
    return figures(run.compiled.step, run.mesh)


def figures(compiled, mesh) -> dict:
    """{"memory": MemoryReport json, "collectives": {axis: payload}} of a compiled train step
    on ``mesh`` (``compile_figures``' reading, for a step compiled elsewhere)."""
    from triax.sharding.introspect import bytes_over, collectives_from_compiled, \
        memory_from_compiled  # loads JAX; see the note at the imports
    cols = collectives_from_compiled(compiled, mesh)
    # A collective over several axes counts toward each; one in a branch of unknown
    # frequency counts at its bound (as if the branch ran every time), never per execution.
    by_axis = {a: bytes_over(cols, axis=a, unknown="at_most")
               for a in sorted({a for c in cols for a in c.axes})}
    return {"memory": memory_from_compiled(compiled).to_json(), "collectives": by_axis}


def _subprocess(w: Workload, lay: Layout, timeout: float) -> dict:
    env = dict(os.environ, JAX_NUM_CPU_DEVICES=str(lay.devices), JAX_PLATFORMS="cpu",
               TF_CPP_MIN_LOG_LEVEL="3")
    arg = json.dumps({"model": w.cfg.name, "layers": w.cfg.num_layers,
                      "max_seq_len": w.cfg.max_seq_len, "dtype": w.dtype,
                      "batch": w.batch, "seq": w.seq, "remat": w.remat,
                      "loss_chunks": w.loss_chunks,
                      "sizes": lay.sizes, "strategy": lay.strategy.name,
                      "tp_overlap": lay.tp_overlap, "offload": lay.offload,
                      "schedule": lay.schedule and lay.schedule.value, "microbatches": lay.microbatches,
                      "virtual": lay.virtual, "attention": w.attention,
                      "context_attention": lay.context_attention,
                      "pipeline_fsdp": lay.pipeline_fsdp, "lora": _lora_fields(w)})
    proc = subprocess.run([sys.executable, "-m", "triax.planner.verify", arg], env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        raise ValueError(f"verify of {lay.describe()} failed: {proc.stderr.strip()[-800:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def verify(w: Workload, lay: Layout, timeout: float = 600.0) -> dict:
    """Predicted beside compiled, for memory (modelled terms, no overhead) and per-axis
    collective payload bytes. Mixed-precision plans are compiled and predicted as fp32."""
    if w.cfg is None:
        raise ValueError("--verify needs a model (--model NAME), not only --params")
    if not w.train:
        raise ValueError("--verify compiles the train step; use it with --train")
    # XLA's CPU backend runs bf16/fp16 arithmetic and collectives in fp32, so a CPU compile
    # of a mixed-precision plan is checked as the fp32 plan it actually compiles to, with
    # the attention kernel the CPU runs (`auto` is the reference kernel there).
    w = dataclasses.replace(w, dtype="fp32", backend="cpu")
    return compare(w, lay, _in_process_or_subprocess(w, lay, timeout))


def compare(w: Workload, lay: Layout, got: dict) -> dict:
    """``verify``'s rows: the plan's predictions beside ``got``, the :func:`figures` of its
    train step compiled as fp32 on simulated CPU devices."""
    mem = estimate(w, lay)
    predicted_comm = {a: t.payload for a, t in traffic(w, lay).items()}
    axes = sorted(set(predicted_comm) | set(got["collectives"]))
    batch_bytes = 2 * (w.batch // lay.batch_shards) * w.seq * 4    # int32 inputs, targets
    state = got["memory"]["argument_bytes"] - batch_bytes
    return {"plan": f"{lay.describe()} remat={w.remat}"
                    + (f" loss_chunks={w.loss_chunks}" if w.loss_chunks > 1 else ""), "compiled_as": "fp32 on simulated CPU devices",
            "memory": {"predicted": mem.modelled, "compiled": got["memory"]["peak_bytes"],
                       "predicted_state": mem.params + mem.optimizer,
                       "compiled_state": state,
                       "predicted_host": mem.host,
                       "compiled_host": got["memory"]["host_argument_bytes"],
                       "compiled_temp": got["memory"]["temp_bytes"]},
            "comm": {a: {"predicted": predicted_comm.get(a, 0.0),
                         "compiled": got["collectives"].get(a, 0)} for a in axes}}


def _in_process_or_subprocess(w: Workload, lay: Layout, timeout: float) -> dict:
    jax = sys.modules.get("jax")   # in process only where the caller already runs JAX
    if jax is not None and len(jax.devices()) == lay.devices:
        return compile_figures(w, lay)
    return _subprocess(w, lay, timeout)


def verify_trainer(trainer, batch, device: str = "h100-80gb",
                   device_memory: Optional[float] = None, hardware: Optional[str] = None) -> dict:
    """The compile check for any trainer, a user's model included (``triax.verify``).

    Compiles the step on abstract inputs (``batch``: arrays or ``ShapeDtypeStruct``s; nothing
    is allocated) and compares ``memory_analysis()``'s per-device peak with the memory of
    ``device`` (a name from the hardware catalogue) or ``device_memory`` bytes. Exact for the
    compiled program; the analytic planner (``triax plan``) is for transformer configs only.
    """
    from triax.sharding.introspect import memory_from_compiled  # loads JAX; see the imports
    if device_memory is None:
        device_memory = load_catalog(hardware).device(device).memory
        where = device
    else:
        where = f"{human_bytes(device_memory)} per device"
    mem = memory_from_compiled(trainer.lower(batch).compile())
    fits = mem.peak_bytes <= device_memory
    verdict = (f"fits on {where}: {human_bytes(mem.peak_bytes)} peak per device of "
               f"{human_bytes(device_memory)}" if fits else
               f"does not fit on {where}: {human_bytes(mem.peak_bytes)} peak per device, "
               f"{human_bytes(device_memory)} available (largest terms: arguments "
               f"{human_bytes(mem.argument_bytes)}, temporaries {human_bytes(mem.temp_bytes)}); "
               f"try fsdp, remat, more devices or a smaller batch")
    return {"fits": fits, "verdict": verdict, "peak_bytes_per_device": mem.peak_bytes,
            "device_memory": device_memory, "memory": mem.to_json(),
            "mesh": dict(trainer.mesh.shape), "strategy": trainer.strategy.name}


def _main(arg: str) -> None:
    a = json.loads(arg)
    cfg = config.get(a["model"], num_layers=a["layers"]).replace(max_seq_len=a["max_seq_len"])
    if a["lora"]:
        cfg = cfg.replace(lora=RunConfig.of(**a["lora"]).lora.lora_config())
    w = Workload.of(cfg, train=True,
                    dtype=a["dtype"], batch=a["batch"], seq=a["seq"], remat=a["remat"],
                    loss_chunks=a["loss_chunks"],
                    attention=a["attention"], backend="cpu")
    lay = Layout(**a["sizes"], strategy=a["strategy"], schedule=a["schedule"] and ScheduleKind(a["schedule"]),
                 microbatches=a["microbatches"], virtual=a["virtual"],
                 tp_overlap=a["tp_overlap"], offload=tuple(a["offload"]),
                 context_attention=a["context_attention"], pipeline_fsdp=a["pipeline_fsdp"])
    print(json.dumps(compile_figures(w, lay)))


if __name__ == "__main__":
    _main(sys.argv[1])
