"""Every private JAX/jaxlib name triax uses, in one place, each with why no public API serves.

``tests/test_private_jax.py`` imports each and fails loudly, naming it, when JAX moves one;
``CHECKED_ON`` is the jax version they were last checked against.

- ``partial_eval``: dead-code elimination of a jaxpr (``dce_jaxpr``) and its per-primitive
  rules (``dce_rules``, ``_default_dce_rule``, ``has_effects``). The split backward
  (``pipeline.split_backward``, ``pipeline.jaxpr_split``) cuts one pullback into its input-
  and weight-gradient halves by pruning its jaxpr; ``jax.extend`` has the jaxpr types but no
  DCE.
  JAX 0.12 gave the rules a third argument (which Ref inputs are live) and made
  ``has_effects`` take it too: ``dce_eqn`` and ``eqn_has_effects`` below are the one place
  that calls them, with every input live (the pipeline's jaxprs hold no Refs).
- ``scan``'s parameters: since JAX 0.12 a scan equation says how its inputs split into
  consts, carries and xs through flat trees (``ft_in``), not ``num_consts``/``num_carry``;
  ``scan_counts`` reads them (``pipeline.jaxpr_split_run`` splits a scan's body).
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

CHECKED_ON = "0.12.0.1"

hlo_print_options = _hlo.HloPrintOptions


def eqn_has_effects(eqn) -> bool:
    """Whether DCE must keep ``eqn`` though no output is used."""
    return partial_eval.has_effects(eqn, [True] * len(eqn.invars))


def dce_eqn(eqn, used_outs):
    """``(used_inputs, eqn or None)``: ``eqn``'s DCE rule for the outputs ``used_outs``."""
    rule = partial_eval.dce_rules.get(eqn.primitive, partial_eval._default_dce_rule)
    return rule(list(used_outs), [True] * len(eqn.invars), eqn)


def scan_counts(eqn) -> tuple[int, int]:
    """``(num_consts, num_carry)`` of a ``scan`` equation; its xs follow them."""
    consts, carry, _ = eqn.params["ft_in"].unpack()
    return len(consts), len(carry)

