"""Tokenizers, document files and the Grain packing loader (no compiles here)."""
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_helpers import make_tokenizer, sft_records, write_jsonl
from triax.cli.main import main
from triax.text import ByteTokenizer, HFTokenizer, TokenizerError, get_tokenizer, load_tokenizer
from triax.training.data import DataError
from triax.training.data_source import open_data
from triax.training.documents import read_records, to_example
from triax.training.packing import PackedBatches


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def test_hf_tokenizer_from_dir_or_file_round_trips(tok_dir):
    tok = get_tokenizer(tok_dir)
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == 264
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)  # from tokenizer_config.json
    ids = tok.encode("the lazy fox", bos=True, eos=True)
    assert ids[0] == 0 and ids[-1] == 1 and len(ids) < len("the lazy fox") + 2  # merges used
    assert tok.decode(ids) == "the lazy fox"
    same = load_tokenizer(tok_dir + "/tokenizer.json")
    np.testing.assert_array_equal(same.encode("the lazy fox"), ids[1:-1])
    assert isinstance(get_tokenizer(None), ByteTokenizer)


@pytest.mark.parametrize("make,match", [
    (lambda p: str(p / "nope"), "does not exist"),
    (lambda p: str(p), "has no tokenizer.json"),
    (lambda p: _write(p / "tokenizer.json", "{not json"), "is not a valid tokenizer.json"),
])
def test_bad_tokenizer_paths(tmp_path, make, match):
    with pytest.raises(TokenizerError, match=match):
        load_tokenizer(make(tmp_path))


def test_cli_bad_tokenizer_is_a_clean_error(tmp_path, capsys):
    rc = main(["generate", "--model", "tiny", "--prompt", "hi", "--max-new-tokens", "1",
               "--tokenizer", str(tmp_path / "nope")])
    assert rc == 2 and "does not exist" in capsys.readouterr().err


def test_tokenizer_larger_than_the_model_vocabulary(tok_dir, tmp_path):
    big = make_tokenizer(tmp_path, vocab_size=300)
    with pytest.raises(DataError, match="tokenizer has 300 ids but the model's vocabulary "
                                        "is 264"):
        open_data("markov", get_tokenizer(big), 264)


def test_jsonl_and_parquet_records_and_loss_weights(tmp_path):
    recs = [{"text": "ab"}, {"prompt": "Q:", "completion": "A"}]
    jl = write_jsonl(tmp_path / "d.jsonl", recs + [{}] * 0)
    pq.write_table(pa.Table.from_pylist([{"text": "ab", "prompt": None, "completion": None},
                                         {"text": None, "prompt": "Q:", "completion": "A"}]),
                   tmp_path / "d.parquet")
    assert read_records(jl) == recs == read_records(str(tmp_path / "d.parquet"))
    ex = to_example(recs[1], ByteTokenizer())
    # <s> Q : | A </s>: only the completion (and its EOS) is learned
    assert ex["weights"].tolist() == [0, 0, 0, 1, 1]
    assert to_example(recs[0], ByteTokenizer())["weights"].tolist() == [1, 1, 1, 1]


@pytest.mark.parametrize("lines,match", [
    (['{"text": "ok"}', "{broken"], r"d.jsonl:2: not valid JSON"),
    (['{"prompt": "no completion"}'], r"d.jsonl:1: a record needs a 'text' field, or 'prompt' "
                                      r"and 'completion'"),
    ([""], "holds no records"),
])
def test_bad_document_files(tmp_path, lines, match):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=match):
        read_records(str(path))


def _write(path, text):
    path.write_text(text)
    return str(path)


def _drain(it, n):
    return [it.numpy_next() for _ in range(n)]


def test_packed_rows_keep_document_boundaries():
    recs = sft_records(40)
    batches = _drain(PackedBatches(recs, ByteTokenizer(), batch_size=4, seq_len=128, seed=0), 3)
    tok = ByteTokenizer()
    for b in batches:
        assert b["inputs"].shape == (4, 128) and b["positions"].dtype == np.int32
        assert (b["segment_ids"].max(axis=1) >= 2).sum() >= 3   # documents share rows
        assert (b["segment_ids"] > 0).mean() > 0.8              # rows are mostly filled
        for r in range(4):
            seg, pos = b["segment_ids"][r], b["positions"][r]
            for s in range(1, seg.max() + 1):
                at = np.flatnonzero(seg == s)
                np.testing.assert_array_equal(pos[at], np.arange(len(at)))  # restart at 0
                assert b["inputs"][r, at[0]] == tok.bos_id      # each starts with BOS
                assert b["targets"][r, at[-1]] == tok.eos_id    # and ends predicting EOS
            pad = seg == 0
            assert (b["weights"][r][pad] == 0).all()
            np.testing.assert_array_equal(b["targets"][r, :-1][~pad[:-1] & ~pad[1:]
                                          & (seg[:-1] == seg[1:])],
                                          b["inputs"][r, 1:][~pad[:-1] & ~pad[1:]
                                          & (seg[:-1] == seg[1:])])
    # prompts carry no weight: fewer weighted targets than real tokens
    real = sum(int((b["segment_ids"] > 0).sum()) for b in batches)
    assert 0 < sum(float(b["weights"].sum()) for b in batches) < real


def test_long_documents_are_cut_into_row_sized_pieces():
    it = PackedBatches([{"text": "x" * 50}], ByteTokenizer(), batch_size=1, seq_len=16, seed=0)
    b = it.numpy_next()
    assert (b["segment_ids"] == 1).all() and b["positions"][0].tolist() == list(range(16))


def test_packed_loader_resumes_bit_identically_and_shards_per_process():
    recs = sft_records(30)
    args = (recs, ByteTokenizer(), 4, 32, 7)
    straight = _drain(PackedBatches(*args), 6)
    first = PackedBatches(*args)
    _drain(first, 3)
    state = json.loads(json.dumps(first.get_state()))   # as stored in the checkpoint meta
    resumed = PackedBatches(*args)
    resumed.set_state(state)
    for a, b in zip(straight[3:], _drain(resumed, 3)):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
    # two processes holding rows 0:2 and 2:4 pack disjoint shares of the records
    halves = [PackedBatches(*args, rows=slice(i, i + 2)).numpy_next() for i in (0, 2)]
    firsts = [set(map(tuple, _doc_starts(h))) for h in halves]
    assert all(h["inputs"].shape == (2, 32) for h in halves) and not firsts[0] & firsts[1]
    with pytest.raises(ValueError, match="equal contiguous shares"):
        PackedBatches(*args, rows=slice(0, 3))


def _doc_starts(b):
    """Each packed document's first 6 input ids (a fingerprint of the document)."""
    out = []
    for r in range(b["inputs"].shape[0]):
        for s in range(1, b["segment_ids"][r].max() + 1):
            at = np.flatnonzero(b["segment_ids"][r] == s)
            out.append(b["inputs"][r, at[:6]])
    return out
