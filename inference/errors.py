"""The serving errors every inference module raises (a request or setting that cannot be
served; the message says the fix)."""


class InferenceError(ValueError):
    """A request or engine setting that cannot be served; the message says the fix."""


class CacheFullError(InferenceError):
    """A sequence has no KV cache position (or pool block) left."""


class ContextLengthError(InferenceError):
    """A prompt plus its new tokens need more cache positions than the engine has.
    ``fits``: the most new tokens that would fit (0: the prompt alone is too long)."""

    def __init__(self, message: str, fits: int):
        super().__init__(message)
        self.fits = fits
