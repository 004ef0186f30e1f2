"""Corrupt input data (issue 17, item 7), with real damaged files: a truncated ``.npy``, text
that is not UTF-8, token ids past the vocabulary. Each is a clear error at start-up naming
the file and where (byte offset for text and a cut file; the id and its position for ids)."""
import numpy as np
import pytest

from triax.cli.main import main
from triax.text import ByteTokenizer
from triax.training.data import DataError, check_vocab, load_corpus
from triax.training.data_source import open_data
from triax.training.documents import read_records

# Small enough that a run which wrongly starts stops after one cheap step.
RUN = ["--model", "tiny", "--num-layers", "1", "--mesh", "data=8", "--strategy", "dp",
       "--batch-size", "8", "--seq-len", "16", "--steps", "1", "--eval-batches", "0",
       "--no-progress"]


def _truncated_npy(tmp_path):
    path = tmp_path / "ids.npy"
    np.save(path, np.arange(1000, dtype=np.int32) % 250)
    raw = path.read_bytes()
    header = len(raw) - 4000
    path.write_bytes(raw[:header + 2870])   # cut inside id 717 (bytes 2868..2872)
    return path, [f"{str(path)!r} is truncated", "promises 1,000 int32 ids",
                  f"ends at byte {header + 2870:,}, inside id 717"]


def _latin1_text(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_bytes(("hello world\n" * 20).encode() + "café\n".encode("latin-1"))
    return path, [f"{str(path)!r} is not UTF-8 text: byte offset 243 (line 21)", "b'\\xe9'"]


def _ids_past_vocab(tmp_path):
    path = tmp_path / "big_vocab.npy"
    ids = np.arange(5000, dtype=np.int32) % 250
    ids[1234] = 300                           # the tiny model has 264 ids
    np.save(path, ids)
    return path, [f"{str(path)!r}: token id 300 at position 1,234 (of 5,000)",
                  "vocabulary of 264 ids"]


@pytest.mark.parametrize("make", [_truncated_npy, _latin1_text, _ids_past_vocab])
def test_corrupt_data_is_a_clear_error_at_start_up(tmp_path, capsys, make):
    path, expected = make(tmp_path)
    assert main(["train", "--data", str(path), *RUN]) == 2
    err = capsys.readouterr().err
    assert all(e in err for e in expected), err


def test_a_truncated_npy_is_named_by_the_loader(tmp_path):
    path, expected = _truncated_npy(tmp_path)
    with pytest.raises(DataError, match="is truncated") as e:
        load_corpus(str(path))
    assert expected[-1] in str(e.value)


def test_ids_outside_the_vocabulary_are_found_in_any_chunk(tmp_path):
    path, _ = _ids_past_vocab(tmp_path)
    with pytest.raises(DataError, match="token id 300 at position 1,234"):
        open_data(str(path), ByteTokenizer(), 264)
    ids = np.arange(5000, dtype=np.int32) % 250
    ids[4321] = -1                            # negative ids are outside too
    np.save(path, ids)
    with pytest.raises(DataError, match="token id -1 at position 4,321"):
        check_vocab(load_corpus(str(path)), 264, str(path), chunk=1000)


def test_a_jsonl_line_that_is_not_utf8_names_its_byte_offset_and_line(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"is not UTF-8 text: byte offset 28 \(line 2\)"):
        read_records(str(path))
