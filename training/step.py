"""One jit-compiled train step that serves every strategy.

The strategy only changes shardings: parameters and optimizer state come out of ``init``
already split, the batch is split over ``data``, and XLA inserts the collectives (gradient
all-reduce for DP, all-gather/reduce-scatter for FSDP, per-block all-reduces for TP).

    >>> from triax.mesh import make_mesh
    >>> from triax.models import config
    >>> from triax.training.step import Trainer
    >>> trainer = Trainer(config.TINY, make_mesh(data=2, tensor=4), "fsdp_tp")
    >>> state = trainer.init(seed=0)
    >>> state, metrics = trainer.step(state, trainer.example_batch(8, 32))

Pipelining is never guessed: pass ``pipeline=PipelineConfig(...)`` on a mesh with
``pipe > 1`` to run ``triax.pipeline``'s schedule; without it the plain SPMD step runs (the
layer stack is then stored split over ``pipe`` and XLA gathers each layer where it runs).
``triax.training.setup.build_run`` makes that choice once for the CLI, planner and benches.
"""
from __future__ import annotations

from functools import cached_property, partial
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from triax.models.config import ModelConfig
from triax.models.layers import ExecConfig
from triax.models import lora
from triax.models.protocol import stack_loss
from triax.pipeline.pipelined import Pipeline, PipelineConfig
from triax.sharding.context import context_size, zigzag_batch
from triax.sharding.partition import (abstract_model, activation_sharding,
                                      batch_sharding, init_fn, param_shardings)
from triax.sharding.introspect.placement import placement_table
from triax.sharding.rules import Strategy, get_strategy
from triax.training.offload import (DEVICE, HOST, Offload, device_update, host_update,
                                    in_memory, moved)
from triax.training.optim import OptimConfig, lr_schedule, make_optimizer, optimizer_parts
from triax.training.stored_form import StoredForm
from triax.training.user_model import UserModel, user_loss

PyTree = Any
# {"inputs": int32[B, T], "targets": int32[B, T]}, optional "weights": f32[B, T] (loss
# weights) and, for packed documents, "segment_ids" and "positions": int32[B, T].
Batch = dict
BATCH_DTYPES = {"inputs": jnp.int32, "targets": jnp.int32, "weights": jnp.float32,
                "segment_ids": jnp.int32, "positions": jnp.int32}


class Trainer(StoredForm):
    """A model, a mesh and a strategy, compiled into ``init`` and ``step``.

    Internally it works from the abstract model (``self.abstract``: graph, shapes, logical
    axes) and a loss function (``models.protocol.stack_loss`` unless a user's model brings
    its own). ``pipeline`` runs that loss through a
    ``triax.pipeline`` schedule; ``loss_and_grad`` may replace it by any function with the
    signature ``(params, batch) -> ((loss, aux), grads)`` (the step stays the same).
    Every argument is hashable: ``triax.training.step_cache`` keys compiled steps on them.
    """

    auto = None   # triax.auto_trainer's: what was chosen and why (planner.auto_model)

    def __init__(self, model: "ModelConfig | UserModel", mesh: Mesh,
                 strategy: str | Strategy = "dp", *,
                 pipeline: Optional[PipelineConfig] = None,
                 optim: OptimConfig = OptimConfig(), exe: ExecConfig = ExecConfig(),
                 total_steps: int = 100, accum_steps: int = 1,
                 loss_and_grad: Optional[Callable] = None, skip_nonfinite: bool = False,
                 offload: Offload = Offload()):
        if pipeline is not None and loss_and_grad is not None:
            raise ValueError("Trainer: give pipeline= or loss_and_grad=, not both (the "
                             "pipeline computes loss and gradients itself)")
        self.mesh, self.strategy, self.exe = mesh, get_strategy(strategy), exe
        # The built-in decoder and a user's model take one path from here on: an abstract
        # model (graph, shapes, logical axes) and a loss function.
        if isinstance(model, UserModel):
            self.cfg, self.user_model = None, model
            self.abstract = model.abstract()
            self.strategy = self.strategy.with_rules(dict(model.rules))
        else:
            self.cfg, self.user_model = model, None
            self.abstract = abstract_model(model)
        self.accum_steps = int(accum_steps)  # gradient accumulation: micro-steps per step
        self.lora_cfg = None if self.cfg is None else self.cfg.lora
        # A NaN/inf loss or gradient keeps the old parameters and optimizer state (the step
        # counter still advances with the data), decided on device: no host round trip.
        self.skip_nonfinite = bool(skip_nonfinite)
        self.offload = offload   # state kept in the host's memory between steps
        self.pipeline = None if pipeline is None else Pipeline(
            self.cfg if self.user_model is None else self.abstract, mesh, self.strategy,
            pipeline, exe)
        if self.pipeline is not None:
            self.strategy, loss_and_grad = self.pipeline.strategy, self.pipeline.loss_and_grad
        self.optim = optim.resolved(total_steps)
        self.tx = make_optimizer(self.optim)
        self.schedule = lr_schedule(self.optim)
        # The train state's form: the pipeline's stored blocks (stage by stage under
        # uneven stages, Pipeline.stored), else the model's.
        self.stored = self.abstract if self.pipeline is None else self.pipeline.stored
        self.param_shardings = param_shardings(self.stored, mesh, self.strategy)
        self._custom_loss_and_grad = loss_and_grad
        # LoRA: only the adapters train; the base gets no gradients and no optimizer state.
        self.lora = lora.has_adapters(self.abstract.shapes)

    def trainable(self, tree: PyTree) -> PyTree:
        """The trainable part of a parameter-shaped tree: the adapters under LoRA, else all."""
        return lora.split(tree)[0] if self.lora else tree

    def with_trainable(self, params: PyTree, trained: PyTree) -> PyTree:
        """``params`` with its trainable part replaced by ``trained`` (the base untouched)."""
        return lora.join(trained, lora.split(params)[1]) if self.lora else trained

    @classmethod
    def for_model(cls, make_model: Callable, loss_fn: Optional[Callable],
                  mesh: Mesh, strategy: str | Strategy = "fsdp_tp",
                  rules: Optional[dict] = None, *, default: Optional[str] = None,
                  **kw) -> "Trainer":
        """A Trainer for any Flax NNX model whose parameters carry logical axis names.

        ``make_model(rngs) -> nnx.Module``; ``loss_fn(model, batch) -> (loss, aux dict)``, or
        None when the model follows ``triax.models.protocol.PipelineModel`` (its
        ``head_loss`` then defines the loss, pipelined or not); ``rules`` add the model's own
        logical names to the strategy preset (a value is mesh axes, a name the preset knows,
        or None); ``default="replicate"`` replicates parameters without names. Every other
        keyword is the constructor's: ``pipeline=PipelineConfig(...)`` (needs the protocol),
        ``optim=OptimConfig(...)``, ``total_steps``, ``accum_steps``. ``step`` donates the
        state it is given: keep the returned one. See docs/your_model.md.

        To have the mesh and strategy chosen by compiling every candidate, the planner above
        builds the Trainer instead: ``triax.auto_trainer`` (``triax.planner.auto_model``).
        """
        return cls(UserModel.of(make_model, loss_fn, rules, default), mesh, strategy, **kw)

    # ---- shardings -------------------------------------------------------------------------
    @cached_property
    def grad_shardings(self) -> PyTree:
        """Per-parameter shardings under the optimizer rules (gradients and Adam moments) of
        the trainable parameters (the adapters under LoRA)."""
        return self.trainable(param_shardings(self.stored, self.mesh, self.strategy,
                                              optimizer=True))

    @cached_property
    def opt_shardings(self) -> PyTree:
        """Shardings of the optimizer state: moments like the gradients, counters replicated."""
        abstract_opt = jax.eval_shape(self.tx.init, self.trainable(self.stored.shapes))
        replicated = NamedSharding(self.mesh, P())
        return optax.tree_map_params(self.tx, lambda _, s: s, abstract_opt, self.grad_shardings,
                                     transform_non_params=lambda _: replicated)

    @cached_property
    def state_shardings(self) -> PyTree:
        """Shardings of the train state ``{"params", "opt_state", "step"}``, as ``init`` has it."""
        off = self.offload
        return {"params": in_memory(self.param_shardings, HOST) if off.params
                else self.param_shardings,
                "opt_state": in_memory(self.opt_shardings, HOST) if off.optimizer
                else self.opt_shardings,
                "step": NamedSharding(self.mesh, P())}

    def abstract_state(self) -> PyTree:
        """ShapeDtypeStructs with shardings: the Orbax restore target, the AOT-compile input."""
        shapes = jax.eval_shape(self._init_fn(0))
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            shapes, self.state_shardings)

    def batch_sharding(self) -> NamedSharding:
        """How a batch is laid out: rows split over the data-parallel axes."""
        return batch_sharding(self.mesh, self.strategy)

    def placement(self, optimizer: bool = False) -> list:
        """Where every parameter lives (logical axes, spec, shard shape, bytes per device);
        ``optimizer=True``: the optimizer state's layout. No compile."""
        return placement_table(self.stored, self.mesh, self.strategy, optimizer=optimizer)

    # ---- init ------------------------------------------------------------------------------
    def _init_fn(self, seed):
        tx, make_params = self.tx, init_fn(self.abstract, seed)

        def init():
            params = self.to_stored(make_params())
            params = jax.lax.with_sharding_constraint(params, self.param_shardings)
            return self.fresh_state(params)
        return init

    def fresh_state(self, params) -> PyTree:
        """The train state at step 0 around ``params``: a fresh optimizer over the trainable
        ones (traced: call it inside a jit with ``out_shardings=state_shardings``)."""
        return {"params": params, "opt_state": self.tx.init(self.trainable(params)),
                "step": jnp.zeros((), jnp.int32)}

    @cached_property
    def _jitted_init(self):
        # The seed is an argument, not a constant: every seed and re-init shares one compile.
        return jax.jit(lambda seed: self._init_fn(seed)(), out_shardings=self.state_shardings)

    def init(self, seed: int = 0) -> PyTree:
        """Parameters and optimizer state, created already sharded (never whole on one device)."""
        return self._jitted_init(jnp.int32(seed))

    # ---- step ------------------------------------------------------------------------------
    def loss_fn(self) -> Callable:
        """``(params, batch) -> (loss, aux)`` of the model, unpipelined: the protocol's
        ``stack_loss`` (the built-in model, a user's without ``loss_fn``) or the user's."""
        fn = stack_loss if self.user_model is None else self.user_model.loss_fn
        if fn is stack_loss:
            fn = partial(stack_loss, exe=self.exe)
        return user_loss(self.abstract, fn)

    def loss_and_grad(self, params, batch):
        """``((loss, aux), grads)`` for one batch: the pipeline's, a custom one, or autodiff;
        ``grads`` of the trainable parameters only (the base's are stopped zeros: dropped)."""
        if self._custom_loss_and_grad is not None:
            out, grads = self._custom_loss_and_grad(params, batch)
        else:
            # allow_int: an int8 LoRA base (models.quantize) gets float0 grads, dropped below.
            out, grads = jax.value_and_grad(self.loss_fn(), has_aux=True,
                                            allow_int=True)(params, batch)
        return out, self.trainable(grads)

    def accumulated_loss_and_grad(self, params, batch):
        """``loss_and_grad`` averaged over ``accum_steps`` micro-batches (a scan in the step).

        Micro-batch ``i`` takes rows ``i, i+M, i+2M, …`` so every micro-batch stays spread over
        ``data`` (a contiguous split would put each micro-batch on a few data shards).
        """
        M = self.accum_steps
        if M == 1:
            return self.loss_and_grad(params, batch)
        micro = jax.tree.map(lambda x: jnp.swapaxes(
            x.reshape((x.shape[0] // M, M) + x.shape[1:]), 0, 1), batch)

        def body(acc, mb):
            mb = jax.lax.with_sharding_constraint(mb, self.batch_sharding())
            out = self.loss_and_grad(params, mb)
            return jax.tree.map(lambda a, o: a + o / M, acc, out), None
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                             jax.eval_shape(self.loss_and_grad, params,
                                            jax.tree.map(lambda x: x[0], micro)))
        out, _ = jax.lax.scan(body, zeros, micro)
        return out

    @property
    def context_layout(self) -> Optional[str]:
        """The token layout along a split sequence (``sharding.context``): ``"zigzag"`` for
        the built-in model on a context axis (pipelined too), None otherwise (no context
        axis, or a user's model, whose attention sees its own order)."""
        if context_size(self.mesh, self.strategy.rules) == 1 or self.cfg is None:
            return None
        return "zigzag"

    def balanced(self, batch: Batch) -> Batch:
        """The batch in :attr:`context_layout` (unchanged unless that is the zigzag)."""
        if self.context_layout != "zigzag":
            return batch
        return zigzag_batch(batch, context_size(self.mesh, self.strategy.rules))

    def sharding_context(self):
        """What the step is traced under: the strategy's activation shardings, and the
        context hook told the layout :meth:`balanced` put the tokens in."""
        return activation_sharding(self.mesh, self.strategy, self.context_layout)

    def device_params(self, params: PyTree) -> PyTree:
        """``params`` as the state holds them, on the device (traced: offloaded parameters
        are copied from the host, ``training.offload``; others are returned as they are)."""
        return moved(params, self.param_shardings, DEVICE) if self.offload.params else params

    def _step_fn(self, state, batch):
        off = self.offload
        params = self.device_params(state["params"])
        # LoRA dropout: per-token seeds of this step, added before any reordering of tokens.
        batch = self.balanced(lora.with_dropout_seeds(batch, self.lora_cfg, state["step"]))
        with self.sharding_context():
            (loss, aux), grads = self.accumulated_loss_and_grad(params, batch)
        # FSDP: this constraint turns the gradient all-reduce into a reduce-scatter.
        # ZeRO-1: gradients follow the (sharded) optimizer state.
        grads = jax.lax.with_sharding_constraint(grads, self.grad_shardings)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads),
                   "lr": self.schedule(state["step"]), **aux}
        # A NaN/inf loss or gradient keeps the old parameters and optimizer state.
        ok = (jnp.isfinite(loss) & jnp.isfinite(metrics["grad_norm"])
              if self.skip_nonfinite else None)
        trained = self.trainable(params)
        if off.host_update:
            trained, opt_state = host_update(optimizer_parts(self.optim), grads, state["opt_state"], trained, ok,
                                             (self.grad_shardings,
                                              self.trainable(self.param_shardings)))
            trained = moved(trained, self.trainable(self.param_shardings), DEVICE)
        else:
            opt_state = moved(state["opt_state"], self.opt_shardings, DEVICE) \
                if off.optimizer else state["opt_state"]
            trained, opt_state = device_update(self.tx, grads, opt_state, trained, ok)
            if off.optimizer:
                opt_state = moved(opt_state, self.opt_shardings, HOST)
        params = self.with_trainable(params, trained)
        params = jax.lax.with_sharding_constraint(params, self.param_shardings)
        if off.params:
            params = moved(params, self.param_shardings, HOST)
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

    @cached_property
    def _jitted_step(self):
        return jax.jit(self._step_fn,
                       in_shardings=(self.state_shardings, self.batch_sharding()),
                       out_shardings=(self.state_shardings, NamedSharding(self.mesh, P())),
                       donate_argnums=(0,))

    def step(self, state, batch):
        """One optimizer step. ``state`` is donated: use the returned one."""
        return self._jitted_step(state, self.shard_batch(batch))

    def shard_batch(self, batch: Batch) -> Batch:
        """Put each array of ``batch`` on the mesh with ``batch_sharding`` (already there: kept)."""
        sh = self.batch_sharding()
        return {k: v if isinstance(v, jax.Array) and v.sharding == sh else jax.device_put(v, sh)
                for k, v in batch.items()}

    def lower(self, batch: "int | Batch", seq_len: Optional[int] = None,
              keys: tuple = ("inputs", "targets")):
        """Lower the step on abstract inputs (no allocation): for inspection and AOT compiles.

        ``batch``: a batch (arrays or ``ShapeDtypeStruct``s; only shapes and dtypes are used),
        or, for the built-in language model, ``batch_size`` with ``seq_len`` (and the batch's
        ``keys``, from ``BATCH_DTYPES``).
        """
        sh = self.batch_sharding()
        if isinstance(batch, int):
            if seq_len is None:
                raise ValueError("Trainer.lower(batch_size, seq_len): give seq_len, or pass "
                                 "a batch of arrays / ShapeDtypeStructs")
            batch = {k: jax.ShapeDtypeStruct((batch, seq_len), BATCH_DTYPES[k]) for k in keys}
        batch = {k: jax.ShapeDtypeStruct(jnp.shape(v), jnp.result_type(v), sharding=sh)
                 for k, v in batch.items()}
        return self._jitted_step.lower(self.abstract_state(), batch)

    @cached_property
    def jitted_grads(self):
        """The jitted ``(params, batch) -> ((loss, aux), grads)`` that :meth:`grads` runs
        (``.lower(...)`` it to read the compiled program)."""
        def f(params, batch):
            batch = self.balanced(batch)
            with self.sharding_context():
                out, grads = self.loss_and_grad(self.to_stored(params), batch)
            return out, self.to_model(grads)
        return jax.jit(f, in_shardings=(self.model_param_shardings, self.batch_sharding()))

    def grads(self, params, batch):
        """Loss and gradients only (for equivalence checks), sharded like the step; both
        in the model's own form (``to_model``), whatever the stages."""
        return self.jitted_grads(params, self.shard_batch(batch))

    def example_batch(self, batch_size: int, seq_len: int, seed: int = 0) -> Batch:
        """Random token batch for the built-in language model."""
        if self.cfg is None:
            raise ValueError("example_batch makes token batches for the built-in model; build "
                             "your model's batch yourself (a dict of arrays, leading axis = rows)")
        rng = np.random.default_rng(seed)
        toks = rng.integers(0, self.cfg.vocab_size, (batch_size, seq_len + 1), dtype=np.int32)
        return {"inputs": toks[:, :-1], "targets": toks[:, 1:]}
