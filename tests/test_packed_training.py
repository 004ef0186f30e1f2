"""Packed documents and loss masks in the model's loss (plain and pipelined), and a Grain
resume through `train` that is bit-identical (fp32, tiny shapes, few compiles)."""
import jax
import numpy as np
import pytest
from tree_checks import assert_trees_close

from data_helpers import make_tokenizer, sft_records, write_jsonl
from triax.checkpoint import Checkpointer
from triax.mesh import make_mesh
from triax.models import config
from triax.models.visibility import packed_visibility
from triax.pipeline.pipelined import PipelineConfig
from triax.text import ByteTokenizer
from triax.training.config import RunConfig
from triax.training.loop import train
from triax.training.packing import PackedBatches
from triax.training.step import Trainer

CFG = config.TINY.replace(num_layers=2)
TEXTS = ["the quick brown fox", "jumps over", "a lazy dog while mesh axes shard",
         "tensors", "over the dog"]
T = 32


@pytest.fixture(scope="module")
def single(devices):
    """A single-device trainer, its params and a packed batch of TEXTS in 2 rows."""
    trainer = Trainer(CFG, make_mesh(devices=devices[:1]), "dp")
    params = trainer.init(seed=0)["params"]
    packed = PackedBatches([{"text": t} for t in TEXTS], ByteTokenizer(), batch_size=2,
                           seq_len=T, seed=0).numpy_next()
    return trainer, params, packed, jax.jit(trainer.loss_fn())


def _docs(packed):
    """(row, positions in the row) of every packed document."""
    seg = packed["segment_ids"]
    return [(r, np.flatnonzero(seg[r] == s)) for r in range(seg.shape[0])
            for s in range(1, seg[r].max() + 1)]


def test_packed_batch_gives_each_documents_own_loss(single):
    trainer, params, packed, loss = single
    docs = _docs(packed)
    assert len(docs) >= len(TEXTS) and packed["segment_ids"].max() >= 3   # rows are shared
    for r, at in docs:
        w = np.zeros_like(packed["weights"])
        w[r, at] = 1.0
        got = float(loss(params, {**packed, "weights": w})[0])
        # the document alone: its own row from position 0, plain causal attention
        alone = {k: np.zeros((1, T), packed[k].dtype) for k in ("inputs", "targets", "weights")}
        for k in ("inputs", "targets"):
            alone[k][0, :len(at)] = packed[k][r, at]
        alone["weights"][0, :len(at)] = 1.0
        want = float(loss(params, alone)[0])
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=0)


def test_segment_mask_is_causal_within_documents():
    m = np.asarray(packed_visibility(np.array([[1, 1, 2, 2, 0]])).mask())[0]
    assert m.tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0],
                          [0, 0, 0, 0, 1]]


def test_only_completion_tokens_count_in_the_loss(single):
    trainer, params, _, loss = single
    rec = {"prompt": "Q: the fox?", "completion": " jumps."}
    b = PackedBatches([rec], ByteTokenizer(), batch_size=1, seq_len=T, seed=0).numpy_next()
    n_prompt = 1 + len(rec["prompt"].encode())            # BOS + the prompt's bytes
    n = n_prompt + len(rec["completion"].encode()) + 1    # ... + completion + EOS
    # targets[t] is token t+1: it is a completion token from t = n_prompt - 1 on
    want_w = np.zeros(T, np.float32)
    want_w[n_prompt - 1:n - 1] = 1.0
    np.testing.assert_array_equal(b["weights"][0], want_w)
    # each target's own nll: the loss with all weight on that one target
    nll = np.array([float(loss(params, {**b, "weights": np.eye(T, dtype=np.float32)[t][None]})[0])
                    for t in range(T)])
    expected = nll[n_prompt - 1:n - 1].mean()
    np.testing.assert_allclose(float(loss(params, b)[0]), expected, rtol=1e-5)
    assert abs(nll[:n - 1].mean() - expected) > 1e-3   # the prompt would change it


def test_pipeline_carries_segment_ids_and_positions(single, devices):
    trainer, params, packed, _ = single
    rows = {k: np.concatenate([v, v[::-1]]) for k, v in packed.items()}   # 4 rows, 2 per mb
    (ref_loss, _), ref_grads = trainer.grads(params, rows)
    piped = Trainer(CFG, make_mesh(pipe=2, devices=devices[:2]), "dp",
                    pipeline=PipelineConfig("gpipe", 2))
    (loss, _), grads = piped.grads(jax.device_put(jax.device_get(params),
                                                  piped.param_shardings), rows)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    assert_trees_close(jax.device_get(grads), jax.device_get(ref_grads), rtol=1e-5, atol=1e-7,
                       what="pipelined packed gradients")


def test_grain_resume_is_bit_identical(tmp_path, devices):
    """jsonl + an HF tokenizer: 4 steps straight == 2 steps, saved, resumed for 2 more."""
    data = write_jsonl(tmp_path / "sft.jsonl", sft_records(40))
    base = RunConfig.of(model="tiny", num_layers=1, data=data, tokenizer=make_tokenizer(tmp_path),
                        batch_size=8, seq_len=T, mesh="data=8", strategy="dp", steps=4, lr=1e-2,
                        lr_warmup_steps=1, lr_decay_steps=4, seed=5, eval_batches=0,
                        progress=False)
    quiet = dict(note=lambda *_: None)
    straight = train(base, **quiet).losses
    ck = str(tmp_path / "ck")
    first = train(base.replace(steps=2, checkpoint_dir=ck), **quiet).losses
    meta = Checkpointer(ck, read_only=True).read_meta(2)
    assert meta["data_state"][0]["position"] == 2 and "grain" in meta["data_state"][0]
    rest = train(base.replace(checkpoint_dir=ck, resume=True), **quiet).losses
    assert first + rest == straight   # exact float equality, step by step
