"""The streaming detokenizer (``serving.detokenize``): its deltas add up to the whole list's
decode on byte-level BPE (the Llama fixture), a SentencePiece-style tokenizer (Llama 2's
decoder: a leading-space marker stripped at the start, byte fallback) and raw bytes, and it
decodes a bounded window per token, not the whole list."""
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models

from triax.serving.detokenize import Detokenizer
from triax.text.byte_tokenizer import ByteTokenizer
from triax.text.hf_tokenizer import HFTokenizer, load_tokenizer
from tests.hf_fixtures import fixture

TEXTS = ["Hello world, hello again.", " leading space and  two", "naïve café — 東京 🚀 ok",
         "🚀🚀 x"]


def sentencepiece_like() -> HFTokenizer:
    """Llama 2's decoder over a tiny vocabulary: ▁-prefixed words and every byte."""
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    for w in ["▁hello", "▁world", "▁", "lo", "he", "▁東京"]:
        vocab[w] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, [], byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return HFTokenizer(tok, {}, "sentencepiece-like")


@pytest.fixture(scope="module", params=["byte-level-bpe", "sentencepiece", "bytes"])
def tokenizer(request):
    return {"byte-level-bpe": lambda: load_tokenizer(fixture("llama")),
            "sentencepiece": sentencepiece_like, "bytes": ByteTokenizer}[request.param]()


def streamed(tok, ids, stop=()) -> tuple[str, Detokenizer]:
    d = Detokenizer(tok, stop)
    text = "".join(d.push(t) for t in ids)
    return text + d.flush(), d


def test_deltas_add_up_to_the_whole_decode(tokenizer):
    rng = np.random.default_rng(0)
    runs = [tokenizer.encode(t) for t in TEXTS]
    # random ids too: byte pieces that split characters, specials, anything a model may emit;
    # not for byte fallback, whose decode spoils valid text before invalid bytes (its module)
    if getattr(tokenizer, "source", "") != "sentencepiece-like":
        runs += [rng.integers(0, tokenizer.vocab_size, 60) for _ in range(5)]
    for ids in runs:
        assert streamed(tokenizer, ids)[0] == tokenizer.decode(ids), list(ids)


def test_stop_string_split_across_windows(tokenizer):
    ids = tokenizer.encode("alpha beta gamma delta " * 3)
    text, d = streamed(tokenizer, ids, stop=["gamma delta alpha"])
    assert d.stopped and text == "alpha beta "


class Counting:
    """A tokenizer that records how many ids each decode call was given."""

    def __init__(self, tok):
        self.tok, self.sizes = tok, []

    def decode(self, ids):
        self.sizes.append(len(ids))
        return self.tok.decode(ids)


def test_each_token_decodes_a_bounded_window(tokenizer):
    ids = np.tile(tokenizer.encode("naïve café — 東京 and more words "), 20)
    counting = Counting(tokenizer)
    d = Detokenizer(counting)
    text = "".join(d.push(t) for t in ids)
    assert text == tokenizer.decode(ids)   # (flush, a whole decode once, has nothing left)
    # a window: its context and the tokens of one (possibly multi-token) character
    assert max(counting.sizes) <= 16, max(counting.sizes)
    assert sum(counting.sizes) < 20 * len(ids)
