"""The warning a run's settings raise when legal but probably not what was meant: its own
home (no imports), so ``training.config`` and what it calls (``training.init_from``) share
it without importing each other."""


class RunConfigWarning(UserWarning):
    """A setting that is legal but probably not what was meant."""
