"""Text in and out: tokenizers (the byte-level one today)."""
from triax.text.byte_tokenizer import BYTE_VOCAB, ByteTokenizer

__all__ = ["BYTE_VOCAB", "ByteTokenizer"]
