"""The planner knows adapters: its memory for a LoRA run matches the compile (``verify``), and
its advice says LoRA makes llama3-8b fit on 1 and on 2 × 80 GB where full fine-tuning fits
on no plan."""
import pytest

from triax.models import config
from triax.models.config import LoraConfig
from triax.costs import hardware
from triax.planner.lora_advice import best_fit, lora_reasoning
from triax.planner.recommend import plan
from triax.planner.verify import verify
from triax.costs.workload import Layout, Workload


@pytest.mark.parametrize("gpus", [1])  # 2 × 80 GB: docs/benchmarks.md (its search compiles op costs)
def test_lora_makes_llama3_8b_fit(gpus):
    cluster = hardware.load_catalog().cluster("h100-80gb", gpus, 1)
    full = Workload.of(config.LLAMA3_8B, train=True, dtype="bf16", batch=8, seq=2048)
    with pytest.raises(ValueError, match="LoRA would fit: --lora-rank 16 --base-dtype "
                                         "bfloat16 trains on"):
        plan(full, cluster, top=1)
    lora = Workload.of(config.LLAMA3_8B.replace(lora=LoraConfig(16, 32.0,
                                                                base_dtype="bfloat16")),
                       train=True, dtype="bf16", batch=8, seq=2048)
    # The plan's sentence (plan() adds it to its reasoning; asked directly here, since a
    # pipelined best plan would make plan() compile its op-cost measurement).
    assert best_fit(lora, cluster) is not None
    assert lora_reasoning(lora, cluster) == [
        f"Full fine-tuning of llama3-8b fits on no plan of {cluster.describe()}: LoRA "
        f"(--lora-rank 16 --base-dtype bfloat16) makes it fit."]


def test_planned_lora_state_matches_the_compile(devices):
    cfg = config.TINY.replace(num_layers=2, lora=LoraConfig(rank=4, base_dtype="bfloat16"))
    w = Workload.of(cfg, train=True, dtype="fp32", batch=8, seq=16)
    got = verify(w, Layout(data=2, tensor=4, strategy="fsdp_tp"))
    mem = got["memory"]
    # The state (frozen bf16 base, fp32 adapters and their moments) is exact.
    assert mem["predicted_state"] == pytest.approx(mem["compiled_state"], abs=64), mem
