"""Every private JAX name triax uses (``triax.private_jax``) still exists: a JAX upgrade that
moves one fails here, naming it, rather than deep inside a pipeline or an HLO report."""
import sys

import jax
import pytest

from triax import private_jax

USED = [
    ("partial_eval.dce_jaxpr", lambda: private_jax.partial_eval.dce_jaxpr),
    ("partial_eval.dce_rules", lambda: private_jax.partial_eval.dce_rules),
    ("partial_eval._default_dce_rule", lambda: private_jax.partial_eval._default_dce_rule),
    ("partial_eval.has_effects", lambda: private_jax.partial_eval.has_effects),
    ("jaxlib._hlo.HloPrintOptions.print_large_constants",
     lambda: private_jax.hlo_print_options().print_large_constants),
    ("jax._src.xla_bridge._backends", lambda: sys.modules["jax._src.xla_bridge"]._backends),
]


@pytest.mark.parametrize("name,get", USED, ids=[n for n, _ in USED])
def test_private_name_still_exists(name, get):
    try:
        get()
    except (AttributeError, KeyError) as e:
        pytest.fail(f"JAX {jax.__version__} moved {name} (checked on "
                    f"{private_jax.CHECKED_ON}); see triax/private_jax.py: {e}")


def test_no_private_import_elsewhere():
    """``private_jax`` is the one module that imports ``jax._src`` or a private jaxlib module."""
    from package_files import ROOT, python_files
    offenders = [str(p.relative_to(ROOT)) for p in python_files(frozenset({"tests"}))
                 if p.name != "private_jax.py"
                 and any(line.lstrip().startswith(("from jax._src", "import jax._src",
                                                   "from jaxlib import _"))
                         for line in p.read_text().splitlines())]
    assert offenders == []


def test_large_constants_printed():
    """What the printer is for: a compiled constant table shows whole (as_text elides it)."""
    import jax.numpy as jnp
    import numpy as np
    from triax.sharding.introspect.hlo_text import compiled_text
    table = jnp.asarray(np.arange(40, dtype=np.int32) * 7 + 3)
    compiled = jax.jit(lambda i: table[i]).lower(jnp.int32(0)).compile()
    assert "276" in compiled_text(compiled)   # 39 * 7 + 3, deep inside the table
