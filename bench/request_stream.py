"""The serving benches' request stream: ``n`` (prompt ids, max new tokens) pairs of mixed
lengths, the same for a given seed (``serve_load.py`` and ``serve_http.py`` both send it)."""
import random


def requests(n: int, max_prompt: int, max_new: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    return [([rng.randrange(vocab) for _ in range(rng.randint(1, max_prompt))],
             rng.randint(1, max_new)) for _ in range(n)]
