"""An adapter made and saved by real ``peft`` (``tests/fixtures/make_peft_adapter.py``, random
A and B over the ``llama`` fixture) reads into triax unmerged and gives the logits the
PeftModel computed (fp32), on one device and on tensor=2."""
import os

import numpy as np
import pytest

from hf_fixtures import FIXTURES, fixture, forward_logits
from triax.hf.load import load as hf_load
from triax.hf.peft import load_adapted
from triax.mesh import make_mesh

ADAPTER = os.path.join(FIXTURES, "llama-peft-adapter")


def _reference():
    ref = np.load(os.path.join(ADAPTER, "reference.npz"))
    n = len([k for k in ref.files if k.startswith("ids_")])
    return [ref[f"ids_{i}"] for i in range(n)], [ref[f"logits_{i}"] for i in range(n)]


@pytest.mark.parametrize("sizes", [dict(data=1), dict(tensor=2)])
def test_peft_adapter_gives_peft_logits(sizes, devices):
    mesh = make_mesh(**sizes, devices=devices[:max(sizes.values())])
    cfg, params = load_adapted(fixture("llama"), ADAPTER, mesh, "tp")
    assert cfg.lora.rank == 4 and cfg.lora.alpha == 8 and len(cfg.lora.targets) == 7
    rows, want = _reference()
    got = forward_logits(cfg, params, mesh, "tp", rows)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    # The adapter matters: the plain base's logits differ from PEFT's.
    bcfg, bparams, _ = hf_load(fixture("llama"), mesh, "tp")
    base = forward_logits(bcfg, bparams, mesh, "tp", rows)
    assert max(np.abs(b - w).max() for b, w in zip(base, want)) > 1e-3
