"""A ``Server``'s public limits: what ``serving/`` and the CLI read (context length, slots,
dtypes, adapters, the request check), so that they need no engine internals. The
context-length check itself lives in ``inference.context_length``; ``check_request`` asks
it through ``inference.request_router``."""
from __future__ import annotations

import operator
from typing import Sequence

from triax.inference.errors import InferenceError
from triax.inference.request_router import check_servable
from triax.inference.sampling import SamplingConfig
from triax.inference.served_weights import bytes_per_device, describe_weights


class ServerLimits:
    """Read-only facts of a ``Server`` (its ``engines`` and ``slots``)."""

    @property
    def max_len(self) -> int:
        """KV positions one sequence may hold: prompt + max_tokens (the least replica's)."""
        return min(e.ecfg.max_len for e in self.engines)

    @property
    def slots_per_replica(self) -> list[int]:
        """Decode slots of each replica."""
        return [len(row) for row in self.slots]

    @property
    def vocab_size(self) -> int:
        return self.engines[0].cfg.vocab_size

    @property
    def default_sampling(self) -> SamplingConfig:
        """The sampling a request gets unless it says its own (the engines' default)."""
        return self.engines[0].sampling

    @property
    def lora(self):
        """The served LoRA adapters' config (``models.config``), None without adapters."""
        return self.engines[0].cfg.lora

    def check_token_ids(self, prompt: Sequence) -> list[int]:
        """The prompt as ints; ``InferenceError`` for an id outside the vocabulary."""
        return self.engines[0].check_token_ids(prompt)

    def check_request(self, prompt: Sequence, max_new_tokens: int) -> list[int]:
        """The prompt as token ids, if it and ``max_new_tokens`` can be served; else the
        ``InferenceError`` (``ContextLengthError`` past the context: the check's one home,
        ``inference.context_length``) that ``submit`` would raise (some replica's pool
        must hold it: ``inference.request_router``)."""
        prompt = self.check_token_ids(prompt)
        try:
            max_new_tokens = operator.index(max_new_tokens)
        except TypeError:
            raise InferenceError(f"max_new_tokens must be an integer, got "
                                 f"{max_new_tokens!r}") from None
        check_servable(self.engines, len(prompt), max_new_tokens)
        return prompt

    def describe(self) -> str:
        """Each replica's layout, slots, sequence length and KV pool, in one line."""
        from triax.mesh import describe
        pools = ", ".join(f"{e.kv.total} blocks × {e.kv.block_size}" for e in self.engines)
        lora = self.lora   # adapters served unmerged: say which
        return (f"{len(self.engines)} replica(s): "
                + "; ".join(describe(e.mesh) for e in self.engines)
                + f"; {self.slots_per_replica[0]} slots each, sequences up to {self.max_len} "
                f"positions; {describe_weights(self.engines)}; KV pool ({self.kv_dtype}) {pools}"
                + (f"; {lora.describe()}" if lora is not None else ""))

    @property
    def dtype(self) -> str:
        """The served weights' (and compute) dtype: ``bfloat16`` or ``float32``."""
        return self.engines[0].ecfg.dtype

    @property
    def quantize(self) -> str:
        """The served weights' quantization (``--quantize``): ``none`` or ``int8``."""
        return self.engines[0].ecfg.quantize

    @property
    def weight_bytes(self) -> int:
        """The weights' bytes on each device as placed, the largest over the replicas."""
        return max(bytes_per_device(e.params) for e in self.engines)

    @property
    def kv_dtype(self) -> str:
        """What the KV pools store: ``bfloat16``, ``float32`` or ``int8``."""
        return self.engines[0].pool.dtype

    @property
    def kv_pool_bytes(self) -> int:
        """KV pool bytes (k and v, an int8 pool's scales) on each device, the largest over
        the replicas."""
        return max(e.pool.bytes_per_device() for e in self.engines)
