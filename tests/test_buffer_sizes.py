"""The pipeline's buffer pricing (``triax.pipeline.buffer_sizes``) fits a chunk's stashed
shapes from four small traces; the slot layouts planned from them, and the loop's residual
bytes, equal a direct trace's."""
import pytest

from triax import memo_on_disk
from triax.models import config
from triax.models.runtime import ExecConfig
from triax.pipeline import buffer_sizes
from triax.pipeline.buffer_sizes import activation_buffer_bytes
from triax.pipeline.pipelined import PipelineConfig
from triax.pipeline.split_backward import slot_layouts
from triax.pipeline.stash_layout import nbytes


def sizes(inputs, x):
    return nbytes(x), [[(lay.body_bytes, lay.head_bytes) for lay in slot_layouts(inputs, split)]
                       for split in (False, True)]


@pytest.mark.parametrize("model,remat,layers,rows", [
    ("tiny", "none", 5, 7), ("tiny", "none", 3, 1), ("tiny-moe", "full", 6, 5)])
def test_fitted_chunk_equals_a_direct_trace(model, remat, layers, rows):
    cfg, exe = config.get(model), ExecConfig(remat=remat)
    assert (layers, rows) not in [(l, r) for l in buffer_sizes._PROBE_LAYERS
                                  for r in buffer_sizes._PROBE_ROWS]
    got = buffer_sizes._slot_inputs(cfg, layers, exe, rows, 32)
    want = buffer_sizes._trace_slot_inputs(cfg, layers, exe, rows, 32)
    assert sizes(*got) == sizes(*want)
    assert buffer_sizes._loop_residual_bytes(cfg, layers, exe, rows, 32) \
        == buffer_sizes._trace_loop_bytes(cfg, layers, exe, rows, 32)


def test_the_loop_is_traced_once(monkeypatch):
    """The loop's residual bytes come from one trace of the chunk's layer loop: its outputs'
    shapes (the pullback's cotangents) from the residuals' trace, not a second one."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return run_stack(*args, **kwargs)
    run_stack = buffer_sizes.run_stack
    monkeypatch.setattr(buffer_sizes, "run_stack", counted)
    fresh = buffer_sizes._trace_loop_bytes.__wrapped__.__wrapped__    # no memo in front
    assert fresh(config.get("tiny"), 2, ExecConfig(), 2, 32) > 0
    assert len(calls) == 1


def test_a_models_probes_share_one_abstract_model(monkeypatch):
    """The stash's and the loop's probe traces of one model build their chunks from one
    ``abstract_model`` (``nnx.eval_shape`` of the whole constructor), not one per trace."""
    calls = []
    abstract_module = buffer_sizes.abstract_model.__globals__["abstract_module"]

    def counted(*args, **kwargs):
        calls.append(1)
        return abstract_module(*args, **kwargs)
    monkeypatch.setitem(buffer_sizes.abstract_model.__globals__, "abstract_module", counted)
    cfg = config.get("tiny").replace(num_layers=3)     # a model no other test probes
    buffer_sizes._abstract.cache_clear()
    for layers in buffer_sizes._PROBE_LAYERS:
        buffer_sizes._stage_backward(cfg, layers, ExecConfig(), 2, 32)
        buffer_sizes._trace_loop_bytes.__wrapped__.__wrapped__(cfg, layers, ExecConfig(), 2, 32)
    assert len(calls) == 1


def test_every_depth_of_a_model_shares_its_chunk_traces(monkeypatch):
    """A chunk's traced shapes are its model's at any depth (the chunk is built at its own
    layer count), so the buffer pricing of one model at 2 and at 4 layers traces its
    one-layer chunk once."""
    deep, one = config.get("tiny-moe", num_layers=4), config.get("tiny-moe", num_layers=1)
    exe = ExecConfig(remat="full")
    slot = buffer_sizes._trace_slot_inputs.__wrapped__.__wrapped__      # no memo in front
    assert sizes(*slot(deep, 2, exe, 3, 32)) == sizes(*slot(one, 2, exe, 3, 32))
    traced = []
    real = buffer_sizes._stage_backward
    monkeypatch.setattr(buffer_sizes, "_stage_backward", lambda *a: traced.append(a) or real(*a))
    monkeypatch.delenv(memo_on_disk.ENV, raising=False)       # memory only: a trace is counted
    cfg = config.TINY.replace(name="tiny-depths")             # no other test's model
    for layers in (2, 4):                                     # one layer per stage
        assert activation_buffer_bytes(cfg.replace(num_layers=layers), layers,
                                       PipelineConfig("1f1b", 4), exe, 1, 16)["stash"] > 0
    assert len(traced) == 1
