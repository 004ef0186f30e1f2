"""The planner prices a LoRA step's communication from what it moves (``costs.comm``): the
adapters' gradients only (no all-reduce or reduce-scatter of a frozen base weight), FSDP
still gathering the base, and the adapters' rank-wide all-reduces over ``tensor``. Checked
per mesh axis against the compiled HLO's collectives (``planner.verify``, what ``plan
--verify`` prints), within the 10% the full fine-tuning comm tests use."""
import pytest

from triax.models import config, lora
from triax.models.config import LoraConfig
from triax.pipeline import ScheduleKind
from triax.costs.comm import traffic
from triax.planner.verify import verify
from triax.costs.workload import FP32, Layout, Workload

# No fp32 fsdp on data=8: its path (the base gathered, no base gradient reduced, the
# adapters' reduce-scattered) is fsdp-int8's on the same layout, which differs only in the
# base's bytes (int8 + fp32 scales); pp-fsdp gathers an fp32 base over data. No dp on
# data=8: its one collective, the adapters' gradient all-reduce over data
# (``costs.comm._data_axis``, an optimizer state not split over data), is tp's and
# tp-kv-replicated's data axis, priced and compiled alike (the adapters' elements of one
# replica; test_only_adapter_gradients_are_reduced prices dp's alone).
CASES = {  # name: (base dtype, layers, layout)
    "zero1": ("float32", 2, Layout(data=8, strategy="zero1")),
    "tp": ("float32", 2, Layout(data=4, tensor=2, strategy="tp")),
    # tiny's 2 KV heads on tensor=4: k's and v's adapters are whole (no backward all-reduce)
    "tp-kv-replicated": ("float32", 2, Layout(data=2, tensor=4, strategy="tp")),
    "fsdp-int8": ("int8", 2, Layout(data=8, strategy="fsdp")),
    "pp-fsdp": ("float32", 4, Layout(data=4, pipe=2, strategy="fsdp",
                                     schedule=ScheduleKind.ONE_F_ONE_B, microbatches=4)),
}


def workload(base_dtype, layers):
    cfg = config.get("tiny", num_layers=layers).replace(
        lora=LoraConfig(rank=4, alpha=8.0, base_dtype=base_dtype))
    return Workload.of(cfg, train=True, dtype="fp32", batch=16, seq=32)


@pytest.fixture(scope="module")
def verified(devices):
    return {name: verify(workload(*case[:2]), case[2])["comm"] for name, case in CASES.items()}


@pytest.mark.parametrize("name", list(CASES))
def test_lora_comm_matches_hlo(name, verified):
    comm = verified[name]
    assert comm, "no collectives"
    for axis, v in comm.items():
        assert v["predicted"] == pytest.approx(v["compiled"], rel=0.10), (axis, comm)


@pytest.mark.parametrize("name, buffers", [("tp", 14), ("tp-kv-replicated", 10)])
def test_adapters_tensor_all_reduces_match_hlo(name, buffers, verified):
    """What the adapters add over ``tensor`` (LoRA minus full fine-tuning, the same layout),
    predicted against the compiled difference: rank-wide all-reduces (o and down forward, q,
    k, v, gate and up backward, × 2 layers: 14); with the KV heads whole on every tensor
    rank, k's and v's add none (10)."""
    lay = CASES[name][2]
    w = workload("float32", 2)
    full = verify(Workload.of(w.cfg.replace(lora=None), train=True, dtype="fp32", batch=16,
                              seq=32), lay)["comm"]["tensor"]
    lora_tp = verified[name]["tensor"]
    added = lora_tp["predicted"] - full["predicted"]
    assert added == pytest.approx(lora_tp["compiled"] - full["compiled"], rel=0.10)
    tokens = 16 // lay.data * 32
    assert added == buffers * tokens * w.lora.rank * FP32


def test_only_adapter_gradients_are_reduced():
    """dp: the gradient all-reduce is the adapters' fp32 bytes (``lora.param_count``), not
    the model's; FSDP reduces no base leaf but gathers the base as full fine-tuning does."""
    w = workload("float32", 2)
    dp = traffic(w, Layout(data=8, strategy="dp"))["data"]
    assert dp.payload_by_kind == {"all-reduce": lora.param_count(w.lora, w.cfg) * FP32}
    full = Workload.of(w.cfg.replace(lora=None), train=True, dtype="fp32", batch=16, seq=32)
    fsdp = Layout(data=8, strategy="fsdp")
    got, ref = traffic(w, fsdp)["data"], traffic(full, fsdp)["data"]
    reduced = got.payload_by_kind.get("reduce-scatter", 0) + got.payload_by_kind["all-reduce"]
    assert reduced == lora.param_count(w.lora, w.cfg) * FP32
    # the base's gathers as in full fine-tuning, plus at most two of each adapter (its
    # split ones, forward and backward)
    adapters = lora.param_count(w.lora, w.cfg) * FP32
    base_gathers = ref.payload_by_kind["all-gather"]
    assert base_gathers < got.payload_by_kind["all-gather"] <= base_gathers + 2 * adapters
