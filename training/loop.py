"""The run loop around ``Trainer``: data, progress, metrics, eval, checkpoints, signals.

    >>> from triax.training.config import RunConfig
    >>> from triax.training.loop import train
    >>> result = train(RunConfig(model="tiny", mesh="data=8", strategy="dp", steps=20,
    ...                          data="markov", progress=False))
    >>> result.losses[-1] < result.losses[0]
    True
"""
from __future__ import annotations

import dataclasses
import math
import signal
import time
from dataclasses import dataclass, field
from typing import Optional

import jax
import numpy as np

from triax.mesh import describe, make_hybrid_mesh, make_mesh, mesh_sizes, parse_mesh
from triax.models.config import ModelConfig
from triax.training import metrics as M
from triax.training.step_cache import compiled_for
from triax.training.checkpoint import CheckpointError, Checkpointer, check_compatible, rng_json
from triax.training.config import RunConfig
from triax.training.data import Batches, check_vocab, load_corpus
from triax.training.step import Trainer


class NonFiniteLoss(ValueError):
    """The loss became NaN or inf; the run stopped without saving the bad state."""


class Interrupted(Exception):
    """SIGTERM/SIGINT: a checkpoint was saved (if a directory was given) and the run stopped."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum


@dataclass
class TrainResult:
    losses: list = field(default_factory=list)      # per optimizer step, this run's part
    val_losses: dict = field(default_factory=dict)  # step -> validation loss
    state: object = None
    trainer: Optional[Trainer] = None
    summary: dict = field(default_factory=dict)


# ---- set-up -------------------------------------------------------------------------------
def default_mesh(num_devices: int, cfg: ModelConfig) -> dict[str, int]:
    """data × tensor × pipe with tensor=2 and pipe=2 where the devices allow (8 → 2×2×2)."""
    tensor = 2 if num_devices % 2 == 0 and num_devices >= 4 else 1
    pipe = 2 if num_devices % (2 * tensor) == 0 and num_devices >= 8 and cfg.num_layers % 2 == 0 else 1
    return {"data": num_devices // (tensor * pipe), "tensor": tensor, "pipe": pipe}


def build_mesh(run: RunConfig, cfg: ModelConfig):
    n = jax.device_count()
    sizes = parse_mesh(run.mesh) if run.mesh else default_mesh(n, cfg)
    need = math.prod(v for v in sizes.values() if v > 0)
    if need > n:
        raise ValueError(f"--mesh {run.mesh or sizes} needs {need} devices but only {n} exist; "
                         f"choose sizes whose product is {n}")
    maker = make_hybrid_mesh if jax.process_count() > 1 else make_mesh
    return maker(**sizes)


def pipeline_microbatches(run: RunConfig, mesh) -> int:
    pipe = mesh_sizes(mesh)["pipe"]
    return 1 if pipe == 1 else (run.microbatches or 2 * pipe)


def check_batch(run: RunConfig, mesh) -> None:
    data = mesh_sizes(mesh)["data"]
    micro = run.grad_accum * pipeline_microbatches(run, mesh)
    unit = data * micro
    if run.batch_size % unit or run.batch_size <= 0:
        valid = max(unit, round(run.batch_size / unit) * unit)
        raise ValueError(f"--batch-size {run.batch_size} is not divisible by data ({data}) × "
                         f"micro-batches ({micro}) = {unit}; use e.g. --batch-size {valid}")


def build_trainer(run: RunConfig, cfg: ModelConfig, mesh) -> Trainer:
    """The run's Trainer; with ``pipe > 1`` it runs triax.pipeline's schedule (dense models;
    MoE keeps ``layers -> pipe`` sharding, where XLA gathers each layer where it runs)."""
    kw = {}
    stages = mesh_sizes(mesh)["pipe"]
    if stages > 1 and cfg.moe is None:
        from triax.pipeline.runner import PipelineConfig
        pc = PipelineConfig(run.schedule, run.microbatches, run.virtual)
        pc.build(stages)  # a bad schedule/micro-batch combination fails here, before compiling
        kw["pipeline"] = pc
    return Trainer(cfg, mesh, run.strategy, optim=run.optim_config(), exe=run.exec_config(),
                   total_steps=run.steps, accum_steps=run.grad_accum, **kw)


def open_checkpoints(run: RunConfig, cfg: ModelConfig, trainer: Trainer, note):
    """(checkpointer or None, state or None, data position, start step)."""
    if not run.checkpoint_dir:
        if run.resume:
            raise ValueError("--resume needs --checkpoint-dir DIR")
        return None, None, 0, 0
    ckpt = Checkpointer(run.checkpoint_dir, keep=run.keep_checkpoints,
                        read_only=run.no_save)
    latest = ckpt.latest_step()
    if latest is None:
        if run.resume:
            note(f"triax train: no checkpoint in {ckpt.directory}; starting from step 0")
        return ckpt, None, 0, 0
    if not run.resume:
        raise CheckpointError(f"{ckpt.directory!r} already holds checkpoints (steps "
                              f"{ckpt.steps()}); pass --resume to continue from step {latest}, "
                              f"or choose another --checkpoint-dir")
    meta = ckpt.read_meta(latest)
    check_compatible(meta, cfg, ckpt.directory, latest)
    state, meta = ckpt.restore(latest, trainer.abstract_state())
    note(f"triax train: resumed step {latest} from {ckpt.directory} (saved on "
         f"{meta.get('mesh')} / {meta.get('strategy')}; now {describe(trainer.mesh)} / "
         f"{trainer.strategy.name})")
    return ckpt, state, int(meta["data_position"]), latest


# ---- the loop -----------------------------------------------------------------------------
class _Signals:
    """Turn SIGTERM/SIGINT into a flag the loop checks after each step."""

    def __init__(self):
        self.received: Optional[int] = None
        self._old = {}

    def __enter__(self):
        for s in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[s] = signal.signal(s, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def _handle(self, signum, frame):
        self.received = signum

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)


def stop_requested(sig: _Signals) -> Optional[int]:
    """The signal to stop on; across processes any one's signal stops all at the same step
    (the save is collective, so every process must take it together)."""
    if jax.process_count() == 1:
        return sig.received
    from jax.experimental import multihost_utils
    got = multihost_utils.process_allgather(np.int32(sig.received or 0))
    return int(np.max(got)) or None


def train(run: RunConfig, note=print) -> TrainResult:
    """Run (or resume) training as configured; see the module docstring."""
    t0 = time.perf_counter()
    main = jax.process_index() == 0
    say = note if main else (lambda *a, **k: None)
    cfg = run.model_config()
    mesh = build_mesh(run, cfg)
    check_batch(run, mesh)
    corpus = load_corpus(run.data, run.val_fraction)
    check_vocab(corpus, cfg.vocab_size)
    compiled = compiled_for(run, cfg, mesh, build_trainer)
    trainer = compiled.trainer
    ckpt, state, position, start = open_checkpoints(run, cfg, trainer, say)
    if state is None:
        state = compiled.init(run.seed)
    times = {"setup_s": time.perf_counter() - t0}
    say(f"triax train: {cfg.name} ({cfg.num_params / 1e6:.2f}M params, {cfg.num_layers} layers) "
        f"on {describe(mesh)} [{jax.device_count()} {jax.devices()[0].platform} devices, "
        f"{jax.process_count()} process(es)], strategy {trainer.strategy.name}, data "
        f"{corpus.name} ({len(corpus.tokens):,} tokens)")
    loop = _Loop(run, compiled, corpus, ckpt, main, say, times)
    try:
        with _Signals() as sig:
            result = loop.run(state, position, start, sig)
    finally:
        loop.close()
    return result


class _Loop:
    def __init__(self, run, compiled, corpus, ckpt, main, say, times):
        self.rc, self.compiled, self.corpus, self.ckpt = run, compiled, corpus, ckpt
        self.trainer = trainer = compiled.trainer
        self.main, self.say, self.times = main, say, times
        self.sinks = M.MetricSinks(run.log_json, run.tensorboard, main,
                                   append=run.resume, note=say)
        dev = jax.devices()[0]
        self.peak = M.peak_flops_per_device(dev.device_kind) if dev.platform != "cpu" else None
        self.flops_per_step = trainer.cfg.flops_per_token(run.seq_len) * run.batch_size * run.seq_len
        self.times.update(compile_s=0.0, first_step_s=0.0, steps_s=0.0, eval_s=0.0, ckpt_s=0.0)

    def close(self):
        self.sinks.close()
        if self.ckpt is not None:
            self.ckpt.close()

    def run(self, state, position, start, sig) -> TrainResult:
        run, tr = self.rc, self.trainer
        data = Batches(self.corpus.train, run.batch_size, run.seq_len, run.seed, "train", position)
        sharding = tr.batch_sharding()
        t = time.perf_counter()
        cached = self.compiled.is_step_compiled
        step_fn = self.compiled.step
        self.times["compile_s"] = time.perf_counter() - t
        self.say("triax train: reusing the step compiled earlier in this process" if cached else
                 f"triax train: compiled the step in {self.times['compile_s']:.1f}s "
                 f"(excluded from averages)")
        result = TrainResult(trainer=tr)
        bar = M.progress_bar(run.steps, start, self.main and run.progress)
        for step in range(start + 1, run.steps + 1):
            t = time.perf_counter()
            state, m = step_fn(state, data.next(sharding))
            loss = float(m["loss"])
            dt = time.perf_counter() - t
            self.times["first_step_s" if step == start + 1 else "steps_s"] += dt
            if not math.isfinite(loss):
                raise self._nonfinite(step, loss)
            result.losses.append(loss)
            rec = self._record(step, loss, m, dt)
            if step == run.steps or (run.eval_every and step % run.eval_every == 0):
                val = self.evaluate(state)
                if val is not None:
                    rec["val_loss"] = result.val_losses[step] = val
            self.sinks.write(rec)
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{rec['tokens_per_s']:,.0f}",
                            mfu=M.fmt_mfu(rec["mfu"]), refresh=False)
            signum = stop_requested(sig)
            if signum is not None:
                bar.close()
                raise self._interrupt(signum, step, state, data.position)
            if self.ckpt and not run.no_save and run.checkpoint_every and \
                    step % run.checkpoint_every == 0 and step < run.steps:
                self.save(step, state, data.position)
        bar.close()
        return self._finish(result, state, data.position, start)

    def _record(self, step, loss, m, dt) -> dict:
        tokens = self.rc.batch_size * self.rc.seq_len
        u = M.mfu(self.flops_per_step, dt, jax.device_count(), self.peak)
        return {"step": step, "loss": loss, "tokens_per_s": tokens / dt,
                "lr": float(m["lr"]), "grad_norm": float(m["grad_norm"]), "step_time_s": dt,
                "mfu": u, **{k: float(v) for k, v in m.items() if k.startswith("moe_")}}

    def evaluate(self, state) -> Optional[float]:
        if self.rc.eval_batches <= 0:
            return None
        t = time.perf_counter()
        val = Batches(self.corpus.val, self.rc.batch_size, self.rc.seq_len, self.rc.seed, "val")
        sh = self.trainer.batch_sharding()
        losses = [float(self.compiled.eval_loss(state["params"], val.global_batch(i, sh)))
                  for i in range(self.rc.eval_batches)]
        self.times["eval_s"] += time.perf_counter() - t
        return float(np.mean(losses))

    def meta(self, step, position) -> dict:
        tr = self.trainer
        return {"step": step, "data_position": position, "rng": rng_json(self.rc.seed, step),
                "model": json_safe(dataclasses.asdict(tr.cfg)), "run": self.rc.to_json(),
                "mesh": describe(tr.mesh), "mesh_sizes": mesh_sizes(tr.mesh),
                "strategy": tr.strategy.name, "num_devices": jax.device_count(),
                "num_processes": jax.process_count()}

    def save(self, step, state, position, wait=False):
        t = time.perf_counter()
        if not bool(_all_finite(state["params"])):  # never overwrite good with bad
            raise self._nonfinite(step, "non-finite parameters")
        self.ckpt.save(step, state, self.meta(step, position), wait=wait)
        self.times["ckpt_s"] += time.perf_counter() - t

    def _nonfinite(self, step, loss) -> NonFiniteLoss:
        last = self.ckpt.latest_step() if self.ckpt else None
        kept = (f"; the last good checkpoint (step {last}) in {self.ckpt.directory} is untouched"
                if last is not None else "; no checkpoint was written for this state")
        what = loss if isinstance(loss, str) else f"loss {loss}"
        return NonFiniteLoss(f"{what} at step {step}; stopped without saving{kept}. "
                             f"Try a lower --lr or --precision fp32")

    def _interrupt(self, signum, step, state, position) -> Interrupted:
        name = signal.Signals(signum).name
        if self.ckpt is None or self.rc.no_save:
            return Interrupted(signum, f"received {name} at step {step}; stopped (no checkpoint "
                                       f"directory, nothing saved)")
        self.save(step, state, position, wait=True)
        return Interrupted(signum, f"received {name} at step {step}; saved checkpoint step "
                                   f"{step} to {self.ckpt.directory} (committed); resume with "
                                   f"--resume --checkpoint-dir {self.ckpt.directory}")

    def _finish(self, result, state, position, start) -> TrainResult:
        run = self.rc
        if run.steps > start:
            if self.ckpt and not run.no_save:
                self.save(run.steps, state, position, wait=True)
        result.state = state
        result.summary = summarize(self, result, start)
        return result


@jax.jit
def _all_finite(tree):
    return jax.numpy.all(jax.numpy.stack([jax.numpy.isfinite(x).all()
                                          for x in jax.tree.leaves(tree)]))


def json_safe(obj):
    import json
    return json.loads(json.dumps(obj, default=lambda o: dataclasses.asdict(o)
                                 if dataclasses.is_dataclass(o) else str(o)))


def summarize(loop: _Loop, result: TrainResult, start: int) -> dict:
    """How the run was split and where the time went (printed by the CLI)."""
    from triax.training.run_summary import summary
    return summary(loop, result, start)
