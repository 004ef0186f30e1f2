"""Document files: ``.jsonl`` and ``.parquet`` records -> token examples with loss weights.

A record is ``{"text": ...}`` (every token counts in the loss) or ``{"prompt": ...,
"completion": ...}`` (fine-tuning: only the completion's tokens count). An example is the
record's ids with BOS in front and EOS behind, plus one weight per id; the pipeline
(``triax.training.packing``) shifts them into inputs, targets and target weights.

    >>> from triax.text import ByteTokenizer
    >>> ex = to_example({"prompt": "Q", "completion": "A"}, ByteTokenizer())
    >>> ex["tokens"].tolist(), ex["weights"].tolist()
    ([256, 81, 65, 257], [0.0, 0.0, 1.0, 1.0])
"""
from __future__ import annotations

import json
import os

import numpy as np

from triax.text.tokenizer import Tokenizer
from triax.training.data import DataError, decode_utf8

SUFFIXES = (".jsonl", ".parquet")
FORMS = "a 'text' field, or 'prompt' and 'completion' fields"


def is_document_file(source: str) -> bool:
    return source.endswith(SUFFIXES)


def read_records(path: str) -> list[dict]:
    """All records of a ``.jsonl`` or ``.parquet`` file, checked (clear errors, file:line)."""
    if not os.path.isfile(path) or not os.access(path, os.R_OK):
        raise DataError(f"data file {path!r} does not exist or is not a readable file")
    records = _read_parquet(path) if path.endswith(".parquet") else _read_jsonl(path)
    if not records:
        raise DataError(f"data file {path!r} holds no records; each needs {FORMS}")
    return records


def _read_jsonl(path: str) -> list[dict]:
    out, offset = [], 0
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            line, offset = decode_utf8(raw, path, offset, n), offset + len(raw)
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise DataError(f"{path}:{n}: not valid JSON ({e})") from None
            out.append(_checked(rec, f"{path}:{n}"))
    return out


def _read_parquet(path: str) -> list[dict]:
    import pyarrow.parquet as pq  # only for .parquet: a large import the other sources skip
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError subclasses
        raise DataError(f"cannot read parquet file {path!r}: {e}") from None
    cols = [c for c in ("text", "prompt", "completion") if c in table.column_names]
    return [_checked(r, f"{path} row {i}") for i, r in enumerate(table.select(cols).to_pylist())]


def _checked(rec, where: str) -> dict:
    if isinstance(rec, dict) and isinstance(rec.get("text"), str):
        return {"text": rec["text"]}
    if (isinstance(rec, dict) and isinstance(rec.get("prompt"), str)
            and isinstance(rec.get("completion"), str)):
        return {"prompt": rec["prompt"], "completion": rec["completion"]}
    keys = sorted(rec) if isinstance(rec, dict) else type(rec).__name__
    raise DataError(f"{where}: a record needs {FORMS} (strings); got {keys}")


def to_example(rec: dict, tokenizer: Tokenizer) -> dict:
    """``{"tokens": int32[n], "weights": float32[n]}``: weight 1 where the token counts."""
    bos, eos = tokenizer.bos_id is not None, tokenizer.eos_id is not None
    if "text" in rec:
        toks = tokenizer.encode(rec["text"], bos=bos, eos=eos)
        return {"tokens": toks, "weights": np.ones(len(toks), np.float32)}
    prompt = tokenizer.encode(rec["prompt"], bos=bos)
    completion = tokenizer.encode(rec["completion"], eos=eos)
    return {"tokens": np.concatenate([prompt, completion]).astype(np.int32),
            "weights": np.concatenate([np.zeros(len(prompt), np.float32),
                                       np.ones(len(completion), np.float32)])}
