"""The chunked-prefill workload that tests/test_chunked_prefill.py and tests/test_mixed_step.py
serve: two streams decode while three 40-token prompts arrive (one greedy, one sampled with a
seed, one sharing the first one's blocks), on a 2-layer ``tiny`` with blocks of 4."""
from triax.inference import EngineConfig
from triax.inference.sampling import SamplingConfig
from triax.models import config

CFG = config.TINY.replace(num_layers=2)
BS = 4
STREAMS = [[5, 6, 7], [200, 1]]                      # running when the long prompts come
LONG = list(range(10, 50))                           # 40 tokens: 10 blocks
LONG_SHARED = LONG[:24] + list(range(120, 134))      # its first 6 blocks shared
SAMPLED = SamplingConfig(temperature=0.9, top_k=20)
NEW = 12
# 2 decode rows + 8 prompt tokens (2 blocks) a step: a 40-token prompt takes 5 chunks.
BUDGET = 10
# One prompt bucket (64): few programs to compile.
ECFG = EngineConfig(max_batch=4, max_len=64, min_bucket=64, block_size=BS, prefix_cache=True)


def serve_long_prompts(server, eng, on_token=None) -> list:
    """The streams start; two steps later the long prompts arrive; all served to the end on
    ``server`` (one replica, ``eng``, nothing cached at the start). Their ``Result``s, the
    streams' first; ``on_token(i)``: stream ``i``'s token callback."""
    eng.kv.forget_cached()
    ids = [server.submit(p, NEW, **({"on_token": on_token(i)} if on_token else {}))
           for i, p in enumerate(STREAMS)]
    server._step()
    server._step()
    ids += [server.submit(LONG, NEW), server.submit(LONG, NEW, seed=7, sampling=SAMPLED),
            server.submit(LONG_SHARED, NEW)]
    results = server.run()
    assert server.kv_blocks_in_use == 0 and server.prefilling == [{}]
    return [results[i] for i in ids]
