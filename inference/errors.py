"""The serving errors every inference module raises (a request or setting that cannot be
served; the message says the fix)."""


class InferenceError(ValueError):
    """A request or engine setting that cannot be served; the message says the fix."""


class CacheFullError(InferenceError):
    """A sequence has no KV cache position (or pool block) left."""
