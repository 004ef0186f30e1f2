"""Small data files for the tokenizer and data tests, made on the spot (no downloads)."""
import json
import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

WORDS = "the quick brown fox jumps over a lazy dog while mesh axes shard tensors".split()


def make_tokenizer(directory, vocab_size: int = 264) -> str:
    """A byte-level BPE ``tokenizer.json`` (+ ``tokenizer_config.json``) with <s> </s> <pad>;
    264 ids fit the byte presets' vocabulary."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(WORDS)] * 20, trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "pad_token": "<pad>"}))
    return str(directory)


def sft_records(n: int, seed: int = 0) -> list[dict]:
    """``n`` prompt/completion records of a few words each."""
    rng = random.Random(seed)
    say = lambda k: " ".join(rng.choices(WORDS, k=rng.randint(1, k)))  # noqa: E731
    return [{"prompt": say(6) + "?", "completion": say(8) + "."} for _ in range(n)]


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)
