"""The run loop around a built run (``triax.training.setup``): data, progress, metrics, eval,
checkpoints, signals.

The loss is read one step late: step n+1 is dispatched before step n's loss is turned into
a float, so the host prepares the next batch while the devices compute. Eval, checkpoint,
signal and final steps read their own loss first, so a NaN is handled (``--on-nonfinite``,
``triax.training.faults``) naming its step and batch, and the bad state is never saved. A
failed save (checked after every step, as Orbax saves in the background) stops the run.

    >>> from triax.training.config import RunConfig
    >>> result = train(RunConfig.of(model="tiny", num_layers=1, mesh="data=8", strategy="dp",
    ...                             steps=4, batch_size=8, seq_len=16, lr=1e-2, data="markov",
    ...                             eval_batches=0, progress=False), note=lambda *_: None)
    >>> len(result.losses), result.losses[-1] < result.losses[0]
    (4, True)
"""
from __future__ import annotations

import math
import signal
import time
from dataclasses import dataclass, field
from typing import Optional

import jax
import numpy as np
from jax.experimental import multihost_utils

from triax.checkpoint import training_meta
from triax.mesh import describe
from triax.text.tokenizer import get_tokenizer
from triax.training import metrics
from triax.training.checkpoint import open_checkpoints, restore_step
from triax.training.config import RunConfig
from triax.training.data import process_rows
from triax.training.data_source import DataSource, gather_states, open_data, restore_state
from triax.training.faults import (MAX_ROLLBACKS, NonFiniteLoss, Rollback,
                                   SaveFailed, nonfinite_message)
from triax.training.init_from import initial_state
from triax.training.memory_check import check_train_memory
from triax.training.run_summary import RunStats, summary
from triax.training.setup import Run, build_run
from triax.training.step import Trainer


class Interrupted(Exception):
    """SIGTERM/SIGINT: a checkpoint was saved (if a directory was given) and the run stopped."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum


@dataclass
class TrainResult:
    losses: list = field(default_factory=list)      # per optimizer step, this run's part
    skipped: list = field(default_factory=list)     # (step, batch) dropped by --on-nonfinite skip
    rollbacks: list = field(default_factory=list)   # (bad step, batch, restored step)
    val_losses: dict = field(default_factory=dict)  # step -> validation loss
    state: object = None
    trainer: Optional[Trainer] = None
    summary: dict = field(default_factory=dict)


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
    got = multihost_utils.process_allgather(np.int32(sig.received or 0))
    return int(np.max(got)) or None


def train(run: RunConfig, note=print) -> TrainResult:
    """Run (or resume) training as configured; see the module docstring."""
    t0 = time.perf_counter()
    main = jax.process_index() == 0
    say = note if main else (lambda *a, **k: None)
    built = build_run(run)
    # The checkpoint directory and its model, checked (nothing written) before the step
    # compiles; opened and restored after the memory check.
    opened = open_checkpoints(run, built.model)
    # --init-from DIR brings the model's own tokenizer unless --tokenizer names another.
    ds = run.dataset
    source = open_data(ds.data, get_tokenizer(ds.tokenizer or run.source.init_from),
                       built.model.vocab_size, ds.val_fraction)
    t_compile, was_compiled = time.perf_counter(), built.compiled.is_step_compiled
    if not run.planner.skip_memory_check:   # before any state exists: compiles abstractly
        check_train_memory(built)
    precompile_s = time.perf_counter() - t_compile
    trainer = built.trainer
    resumed = opened.resume(trainer, say)
    if resumed.state is not None:
        state = resumed.state
    elif run.source.init_from:  # fine-tuning: step 0 holds the Hugging Face weights
        state = initial_state(trainer, built.model, run.source.init_from, run.lora.adapter,
                              run.loop.seed)
    else:
        state = built.compiled.init(run.loop.seed)
    cfg = built.model
    say(f"triax train: {cfg.name} ({cfg.num_params / 1e6:.2f}M params, {cfg.num_layers} layers) "
        f"on {describe(built.mesh)} [{jax.device_count()} {jax.devices()[0].platform} devices, "
        f"{jax.process_count()} process(es)], strategy {trainer.strategy.name}, data "
        f"{source.name} ({source.size})"
        + (f"; {cfg.lora.describe()}" if cfg.lora else "")
        + (f", adapter from {run.lora.adapter}" if run.lora.adapter else ""))
    # The memory check's compile is the step's compile: reported as such, not as setup.
    compiled_here = not was_compiled and built.compiled.is_step_compiled
    loop = _Loop(built, source, resumed.ckpt, main, say,
                 {"setup_s": time.perf_counter() - t0 - (precompile_s if compiled_here else 0.0),
                  "compile_s": precompile_s if compiled_here else 0.0})
    try:
        with _Signals() as sig:
            result = loop.run(state, resumed, sig)
    finally:
        loop.close()
    return result


@dataclass
class _Pending:
    """A dispatched step whose loss has not been read yet."""

    step: int
    metrics: dict
    dispatched: float  # perf_counter at dispatch
    index: int         # the data position (batch index) the step consumed


class _Loop:
    def __init__(self, built: Run, source: DataSource, ckpt, main, say, times):
        self.rc, self.compiled, self.source, self.ckpt = built.config, built.compiled, source, ckpt
        self.trainer = trainer = built.trainer
        self.main, self.say = main, say
        run, ds = self.rc, self.rc.dataset
        dev = jax.devices()[0]
        self.stats = RunStats(
            steps=run.loop.steps, tokens_per_step=ds.batch_size * ds.seq_len,
            flops_per_step=trainer.cfg.flops_per_token(ds.seq_len) * ds.batch_size * ds.seq_len,
            peak_flops=metrics.peak_flops_per_device(dev.device_kind) if dev.platform != "cpu"
            else None, corpus_info=source.info,
            times={"compile_s": 0.0, **times, "first_step_s": 0.0, "steps_s": 0.0,
                   "eval_s": 0.0, "ckpt_s": 0.0})
        self.sinks = metrics.MetricSinks(run.loop.log_json, run.loop.tensorboard, main,
                                         append=run.checkpoint.resume, note=say)
        self.result = TrainResult(trainer=trainer)
        self._last_done = 0.0   # when the previous step's loss was read
        self._saving: Optional[int] = None   # the step of the last save started

    def close(self):
        self.sinks.close()
        if self.ckpt is not None:
            self.ckpt.close()

    def loader(self, split: str):
        """A fresh ``split`` loader for this process's rows of the batch."""
        ds, sh = self.rc.dataset, self.trainer.batch_sharding()
        return self.source.loader(split, ds.batch_size, ds.seq_len, self.rc.loop.seed,
                                  process_rows(sh, (ds.batch_size, ds.seq_len)))

    def run(self, state, resumed, sig) -> TrainResult:
        run, tr, times = self.rc, self.trainer, self.stats.times
        start, data = resumed.step, self.loader("train")
        restore_state(data, resumed.data_state, resumed.data_position)
        sharding = tr.batch_sharding()
        t = time.perf_counter()
        cached = self.compiled.is_step_compiled and not times.get("compile_s")
        step_fn = self.compiled.step
        times["compile_s"] = times.get("compile_s", 0.0) + time.perf_counter() - t
        self.say("triax train: reusing the step compiled earlier in this process" if cached else
                 f"triax train: compiled the step in {times['compile_s']:.1f}s "
                 f"(excluded from averages)")
        self.bar = metrics.progress_bar(run.loop.steps, start, self.main and run.loop.progress)
        self._first = start + 1
        self._start = start
        step = start
        while step < run.loop.steps:
            try:
                state, step = self._steps(state, step, data, step_fn, sharding, sig)
            except Rollback as bad:   # only in --on-nonfinite rollback
                state, step = self._rollback(bad, data)
        self.bar.close()
        return self._finish(state, data, start)

    def _steps(self, state, step, data, step_fn, sharding, sig):
        """Run steps from ``step + 1`` to the end (a ``Rollback`` leaves early)."""
        steps, every, ck = self.rc.loop.steps, self.rc.dataset.eval_every, self.rc.checkpoint
        pending: Optional[_Pending] = None
        for step in range(step + 1, steps + 1):
            index = data.position
            batch = data.next(sharding)
            t = time.perf_counter()
            state, m = step_fn(state, batch)
            if pending is not None:   # step-1's loss, read while this step runs
                self._complete(pending)
            pending = _Pending(step, m, t, index)
            self._check_saves()
            evaluate = step == steps or (every and step % every == 0)
            save = (self.ckpt and not ck.no_save and ck.checkpoint_every and
                    step % ck.checkpoint_every == 0 and step < steps)
            signum = stop_requested(sig)
            if evaluate or save or signum is not None:
                self._complete(pending, state if evaluate else None)
                pending = None
            if signum is not None:
                self.bar.close()
                raise self._interrupt(signum, step, state, data)
            if save:
                self.save(step, state, data)
        if pending is not None:
            self._complete(pending)
        return state, step

    def _rollback(self, bad: Rollback, data):
        """Restore the last checkpoint; continue after the bad batch (the data in between is
        skipped; the step counter goes back to the checkpoint's)."""
        if len(self.result.rollbacks) >= MAX_ROLLBACKS:
            self._guarded(self.ckpt.wait)
            raise NonFiniteLoss(nonfinite_message(
                f"{bad.what} again after {MAX_ROLLBACKS} rollbacks", bad.step, bad.index,
                self.ckpt.latest_step(), self.ckpt.directory))
        self._guarded(self.ckpt.wait)
        last = self.ckpt.latest_step()
        if last is None or last < self._start:   # nothing saved yet: the run's first state
            state, step = self.compiled.init(self.rc.loop.seed), 0
        else:
            state, _ = restore_step(self.ckpt, last, self.trainer.cfg, self.trainer)
            step = last
        data.seek(bad.index + 1)
        del self.result.losses[max(step - self._start, 0):]
        self.result.rollbacks.append((bad.step, bad.index, step))
        self.sinks.write({"step": bad.step, "event": "rollback", "batch": bad.index,
                          "restored_step": step, "data_position": data.position})
        self.say(f"triax train: {bad.what} at step {bad.step} (batch {bad.index}); rolled back "
                 f"to step {step} and skipped the data up to batch {bad.index} (continuing "
                 f"at data position {data.position})")
        self.bar.n = step
        self.bar.refresh()
        return state, step

    def _complete(self, p: _Pending, state_to_eval=None) -> None:
        """Read step ``p.step``'s loss (waiting for it), stop on NaN, log, maybe evaluate."""
        loss = float(p.metrics["loss"])
        done = time.perf_counter()
        # The step ran from when it was dispatched or the previous one finished, whichever
        # was later (the device runs steps in order).
        dt = done - max(p.dispatched, self._last_done)
        self._last_done = done
        times = self.stats.times
        times["first_step_s" if p.step == self._first else "steps_s"] += dt
        if not math.isfinite(loss):
            if self.rc.loop.on_nonfinite != "skip":
                raise self._nonfinite(p.step, f"loss {loss}", p.index)
            self.result.skipped.append((p.step, p.index))
            self.sinks.write({"step": p.step, "event": "skipped_nonfinite", "batch": p.index})
            self.say(f"triax train: loss {loss} at step {p.step} (batch {p.index}); update "
                     f"dropped (--on-nonfinite skip), parameters and optimizer state unchanged")
            self.bar.update(1)
            return
        self.result.losses.append(loss)
        rec = self._record(p.step, loss, p.metrics, dt)
        if state_to_eval is not None:
            val = self.evaluate(state_to_eval)
            if val is not None:
                rec["val_loss"] = self.result.val_losses[p.step] = val
            self._last_done = time.perf_counter()   # eval time is not step time
        self.sinks.write(rec)
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{rec['tokens_per_s']:,.0f}",
                             mfu=metrics.fmt_mfu(rec["mfu"]), refresh=False)

    def _record(self, step, loss, m, dt) -> dict:
        s = self.stats
        u = metrics.mfu(s.flops_per_step, dt, jax.device_count(), s.peak_flops)
        return {"step": step, "loss": loss, "tokens_per_s": s.tokens_per_step / dt,
                "lr": float(m["lr"]), "grad_norm": float(m["grad_norm"]), "step_time_s": dt,
                "mfu": u, **{k: float(v) for k, v in m.items() if k.startswith("moe_")}}

    def evaluate(self, state) -> Optional[float]:
        if self.rc.dataset.eval_batches <= 0:
            return None
        t = time.perf_counter()
        val, sh = self.loader("val"), self.trainer.batch_sharding()
        losses = [float(self.compiled.eval_loss(state["params"], val.next(sh)))
                  for _ in range(self.rc.dataset.eval_batches)]
        self.stats.times["eval_s"] += time.perf_counter() - t
        return float(np.mean(losses))

    def save(self, step, state, data, wait=False):
        """Save ``state`` with every process's ``data`` loader state (collective)."""
        t = time.perf_counter()
        if not bool(_all_finite(state["params"])):  # never overwrite good with bad
            raise self._nonfinite(step, "non-finite parameters", data.position - 1)
        tr = self.trainer
        meta = training_meta(step, data.position, self.rc.loop.seed, tr.cfg, self.rc.to_json(),
                             tr.mesh, tr.strategy.name, gather_states(data.get_state()))
        if self._saving is not None:   # Orbax would wait too; this names the failed step
            self._guarded(self.ckpt.wait)
        self._saving = step
        # The model's [L, ...] form, whatever the stages (Trainer.saved_form).
        saved = tr.to_saved(state)
        self._guarded(lambda: self.ckpt.save(step, saved, meta, wait=wait))
        self.stats.times["ckpt_s"] += time.perf_counter() - t
        self._last_done = time.perf_counter()   # save time is not step time

    def _check_saves(self):
        """Orbax saves in the background: surface a failed save at the next step, not at the
        next save (which may be hours later)."""
        if self.ckpt is not None and self._saving is not None:
            self._guarded(self.ckpt.check_for_errors)

    def _guarded(self, fn):
        try:
            return fn()
        except Exception as e:   # Orbax and the OS raise many types; name the step and cause
            raise SaveFailed.of(self._saving, self.ckpt.directory, e,
                                self.ckpt.latest_step()) from e

    def _nonfinite(self, step, what, index) -> Exception:
        if self.rc.loop.on_nonfinite == "rollback":
            return Rollback(step, index, what)
        if self.ckpt:   # the step being saved commits first: name what is on disk
            self._guarded(self.ckpt.wait)
        last = self.ckpt.latest_step() if self.ckpt else None
        return NonFiniteLoss(nonfinite_message(what, step, index, last,
                                               self.ckpt.directory if self.ckpt else None))

    def _interrupt(self, signum, step, state, data) -> Interrupted:
        name = signal.Signals(signum).name
        if self.ckpt is None or self.rc.checkpoint.no_save:
            return Interrupted(signum, f"received {name} at step {step}; stopped (no checkpoint "
                                       f"directory, nothing saved)")
        self.save(step, state, data, wait=True)
        return Interrupted(signum, f"received {name} at step {step}; saved checkpoint step "
                                   f"{step} to {self.ckpt.directory} (committed); resume with "
                                   f"--resume --checkpoint-dir {self.ckpt.directory}")

    def _finish(self, state, data, start) -> TrainResult:
        run, result = self.rc, self.result
        if run.loop.steps > start and self.ckpt and not run.checkpoint.no_save:
            self.save(run.loop.steps, state, data, wait=True)
        result.state = state
        self.stats.losses = result.losses
        self.stats.val_loss = result.val_losses.get(run.loop.steps)
        result.summary = summary(self.stats, self.compiled, state)
        return result


@jax.jit
def _all_finite(tree):
    # on the device: host-offloaded parameters (training.offload) are copied a leaf at a time
    return jax.numpy.all(jax.numpy.stack([
        jax.numpy.isfinite(jax.device_put(x, jax.memory.Space.Device)).all()
        for x in jax.tree.leaves(tree)]))
