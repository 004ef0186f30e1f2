"""Text in and out: one tokenizer interface, the byte tokenizer and Hugging Face ones."""
from triax.text.byte_tokenizer import BYTE_VOCAB, ByteTokenizer
from triax.text.hf_tokenizer import HFTokenizer, TokenizerError, load_tokenizer
from triax.text.tokenizer import Tokenizer, get_tokenizer

__all__ = ["BYTE_VOCAB", "ByteTokenizer", "HFTokenizer", "Tokenizer", "TokenizerError",
           "get_tokenizer", "load_tokenizer"]
