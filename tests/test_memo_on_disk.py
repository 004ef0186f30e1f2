"""The planner's traces memoised on disk (``memo_on_disk``): read back instead of traced,
missed on other arguments or other code, recomputed over a broken entry."""
import pytest

from triax import memo_on_disk
from triax.memo_on_disk import on_disk
from triax.models import config
from triax.models.runtime import ExecConfig
from triax.pipeline import buffer_sizes


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(memo_on_disk.ENV, str(tmp_path))
    return tmp_path


def counted():
    calls = []

    @on_disk
    def f(cfg, n):
        calls.append(n)
        return {"n": n, "layers": cfg.num_layers}
    return f, calls


def test_a_second_process_reads_what_the_first_computed(cache_dir):
    first, calls = counted()
    assert first(config.TINY, 3) == {"n": 3, "layers": 4}
    second, calls2 = counted()           # a fresh function: nothing in memory
    assert second(config.TINY, 3) == {"n": 3, "layers": 4}
    assert (calls, calls2) == ([3], [])
    second(config.TINY, 4)
    second(config.TINY.replace(num_layers=2), 3)
    assert calls2 == [4, 3]              # other arguments miss


def test_other_code_misses(cache_dir, monkeypatch):
    f, calls = counted()
    f(config.TINY, 3)
    monkeypatch.setattr(memo_on_disk, "code_fingerprint", lambda: "edited")
    f(config.TINY, 3)
    assert calls == [3, 3]


def test_a_broken_entry_is_computed_again(cache_dir):
    f, calls = counted()
    f(config.TINY, 3)
    (entry,) = cache_dir.rglob("*.pkl")
    entry.write_bytes(b"\x80truncated")
    assert f(config.TINY, 3) == {"n": 3, "layers": 4} and calls == [3, 3]


def test_unset_means_memory_only(monkeypatch, tmp_path):
    monkeypatch.delenv(memo_on_disk.ENV, raising=False)
    f, calls = counted()
    f(config.TINY, 3), f(config.TINY, 3)
    assert calls == [3, 3] and not list(tmp_path.iterdir())


def test_buffer_sizes_trace_is_read_back_not_retraced(cache_dir, monkeypatch):
    trace = buffer_sizes._trace_slot_inputs.__wrapped__       # below the in-memory lru_cache
    args = (config.TINY.replace(num_layers=2), 2, ExecConfig(), 2, 16)
    traced = trace(*args)

    def no_trace(*a):
        raise AssertionError("traced again")
    monkeypatch.setattr(buffer_sizes, "_stage_backward", no_trace)
    assert trace(*args) == traced


def test_a_second_process_reads_the_zb_v_orders(cache_dir, monkeypatch):
    """ZB-V's greedy orders (seconds at 16-32 stages, for every plan search over a big
    cluster) are read back, not searched again."""
    from triax.pipeline import generators
    calls = []
    greedy = generators._zb_v_greedy
    monkeypatch.setattr(generators, "_zb_v_greedy", lambda *a: calls.append(a) or greedy(*a))
    first = generators.zb_v_orders(4, 8, 2)
    searched = len(calls)
    assert searched and generators.zb_v_orders(4, 8, 2) == first
    assert len(calls) == searched
