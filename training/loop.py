"""The run loop around a built run (``triax.training.setup``): data, progress, metrics, eval,
checkpoints, signals.

The loss is read one step late: step n+1 is dispatched before step n's loss is turned into
a float, so the host prepares the next batch while the devices compute. Eval, checkpoint,
signal and final steps read their own loss first, so a NaN still stops naming its step and
the bad state is never saved.

    >>> from triax.training.config import RunConfig
    >>> result = train(RunConfig(model="tiny", num_layers=1, mesh="data=8", strategy="dp",
    ...                          steps=4, batch_size=8, seq_len=16, lr=1e-2, data="markov",
    ...                          eval_batches=0, progress=False), note=lambda *_: None)
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
from triax.training import metrics
from triax.training.checkpoint import open_checkpoints
from triax.training.config import RunConfig
from triax.training.data import Batches, check_vocab, load_corpus
from triax.training.init_from import initial_state
from triax.training.run_summary import RunStats, summary
from triax.training.setup import Run, build_run
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
    corpus = load_corpus(run.data, run.val_fraction)
    check_vocab(corpus, built.model.vocab_size)
    trainer = built.trainer
    resumed = open_checkpoints(run, built.model, trainer, say)
    if resumed.state is not None:
        state = resumed.state
    elif run.init_from:  # fine-tuning: step 0 holds the Hugging Face weights
        state = initial_state(trainer, built.model, run.init_from)
    else:
        state = built.compiled.init(run.seed)
    cfg = built.model
    say(f"triax train: {cfg.name} ({cfg.num_params / 1e6:.2f}M params, {cfg.num_layers} layers) "
        f"on {describe(built.mesh)} [{jax.device_count()} {jax.devices()[0].platform} devices, "
        f"{jax.process_count()} process(es)], strategy {trainer.strategy.name}, data "
        f"{corpus.name} ({len(corpus.tokens):,} tokens)")
    loop = _Loop(built, corpus, resumed.ckpt, main, say,
                 {"setup_s": time.perf_counter() - t0})
    try:
        with _Signals() as sig:
            result = loop.run(state, resumed.data_position, resumed.step, sig)
    finally:
        loop.close()
    return result


@dataclass
class _Pending:
    """A dispatched step whose loss has not been read yet."""

    step: int
    metrics: dict
    dispatched: float  # perf_counter at dispatch


class _Loop:
    def __init__(self, built: Run, corpus, ckpt, main, say, times):
        self.rc, self.compiled, self.corpus, self.ckpt = built.config, built.compiled, corpus, ckpt
        self.trainer = trainer = built.trainer
        self.main, self.say = main, say
        run = self.rc
        dev = jax.devices()[0]
        self.stats = RunStats(
            steps=run.steps, tokens_per_step=run.batch_size * run.seq_len,
            flops_per_step=trainer.cfg.flops_per_token(run.seq_len) * run.batch_size * run.seq_len,
            peak_flops=metrics.peak_flops_per_device(dev.device_kind) if dev.platform != "cpu"
            else None, corpus_info=corpus.info,
            times={**times, "compile_s": 0.0, "first_step_s": 0.0, "steps_s": 0.0,
                   "eval_s": 0.0, "ckpt_s": 0.0})
        self.sinks = metrics.MetricSinks(run.log_json, run.tensorboard, main,
                                         append=run.resume, note=say)
        self.result = TrainResult(trainer=trainer)
        self._last_done = 0.0   # when the previous step's loss was read

    def close(self):
        self.sinks.close()
        if self.ckpt is not None:
            self.ckpt.close()

    def run(self, state, position, start, sig) -> TrainResult:
        run, tr, times = self.rc, self.trainer, self.stats.times
        data = Batches(self.corpus.train, run.batch_size, run.seq_len, run.seed, "train", position)
        sharding = tr.batch_sharding()
        t = time.perf_counter()
        cached = self.compiled.is_step_compiled
        step_fn = self.compiled.step
        times["compile_s"] = time.perf_counter() - t
        self.say("triax train: reusing the step compiled earlier in this process" if cached else
                 f"triax train: compiled the step in {times['compile_s']:.1f}s "
                 f"(excluded from averages)")
        self.bar = metrics.progress_bar(run.steps, start, self.main and run.progress)
        self._first = start + 1
        pending: Optional[_Pending] = None
        for step in range(start + 1, run.steps + 1):
            batch = data.next(sharding)
            t = time.perf_counter()
            state, m = step_fn(state, batch)
            if pending is not None:   # step-1's loss, read while this step runs
                self._complete(pending)
            pending = _Pending(step, m, t)
            evaluate = step == run.steps or (run.eval_every and step % run.eval_every == 0)
            save = (self.ckpt and not run.no_save and run.checkpoint_every and
                    step % run.checkpoint_every == 0 and step < run.steps)
            signum = stop_requested(sig)
            if evaluate or save or signum is not None:
                self._complete(pending, state if evaluate else None)
                pending = None
            if signum is not None:
                self.bar.close()
                raise self._interrupt(signum, step, state, data.position)
            if save:
                self.save(step, state, data.position)
        if pending is not None:
            self._complete(pending)
        self.bar.close()
        return self._finish(state, data.position, start)

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
            raise self._nonfinite(p.step, loss)
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
        if self.rc.eval_batches <= 0:
            return None
        t = time.perf_counter()
        val = Batches(self.corpus.val, self.rc.batch_size, self.rc.seq_len, self.rc.seed, "val")
        sh = self.trainer.batch_sharding()
        losses = [float(self.compiled.eval_loss(state["params"], val.global_batch(i, sh)))
                  for i in range(self.rc.eval_batches)]
        self.stats.times["eval_s"] += time.perf_counter() - t
        return float(np.mean(losses))

    def save(self, step, state, position, wait=False):
        t = time.perf_counter()
        if not bool(_all_finite(state["params"])):  # never overwrite good with bad
            raise self._nonfinite(step, "non-finite parameters")
        tr = self.trainer
        meta = training_meta(step, position, self.rc.seed, tr.cfg, self.rc.to_json(), tr.mesh,
                             tr.strategy.name)
        self.ckpt.save(step, state, meta, wait=wait)
        self.stats.times["ckpt_s"] += time.perf_counter() - t
        self._last_done = time.perf_counter()   # save time is not step time

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

    def _finish(self, state, position, start) -> TrainResult:
        run, result = self.rc, self.result
        if run.steps > start and self.ckpt and not run.no_save:
            self.save(run.steps, state, position, wait=True)
        result.state = state
        self.stats.losses = result.losses
        self.stats.val_loss = result.val_losses.get(run.steps)
        result.summary = summary(self.stats, self.compiled, state)
        return result


@jax.jit
def _all_finite(tree):
    return jax.numpy.all(jax.numpy.stack([jax.numpy.isfinite(x).all()
                                          for x in jax.tree.leaves(tree)]))
