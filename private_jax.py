"""Every private JAX/jaxlib name triax uses, in one place, each with why no public API serves.

``tests/test_private_jax.py`` imports each and fails loudly, naming it, when JAX moves one;
``CHECKED_ON`` is the jax version they were last checked against.

- ``partial_eval``: dead-code elimination of a jaxpr (``dce_jaxpr``) and its per-primitive
  rules (``dce_rules``, ``_default_dce_rule``, ``has_effects``). The split backward
  (``pipeline.split_backward``, ``pipeline.jaxpr_split``) cuts one pullback into its input-
  and weight-gradient halves by pruning its jaxpr; ``jax.extend`` has the jaxpr types but no
  DCE.
- ``hlo_print_options``: jaxlib's ``HloPrintOptions`` prints a compiled module with its large
  constants (the tick table a ``lax.switch`` indexes), which ``compiled.as_text()`` elides;
  ``sharding.introspect`` reads branch frequencies from it.
- ``jax._src.xla_bridge._backends``: whether a JAX backend exists yet, asked without starting
  one (starting it would freeze the simulated device count). ``mesh.simulate`` reads it from
  ``sys.modules`` and so stays JAX-free; it is named here and tested with the rest.
"""
from __future__ import annotations

from jax._src.interpreters import partial_eval  # noqa: F401  (see above)
from jaxlib import _hlo

CHECKED_ON = "0.10.2"

hlo_print_options = _hlo.HloPrintOptions

