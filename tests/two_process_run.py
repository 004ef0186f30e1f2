"""The 2-process training run (2 processes × 4 simulated CPU devices, gloo on 127.0.0.1) that
``test_training_multiprocess`` and ``test_training_dead_peer`` both start. One config, so the
two compile the same programs: whichever runs later loads them from the suite's persistent
compilation cache in both its processes (a process compiles each otherwise)."""
import socket

from triax.training.config import RunConfig

# The schedule is pinned (warmup, decay), so losses depend on the step only, not on --steps.
BASE = RunConfig.of(model="tiny", num_layers=1, data="markov", batch_size=8, seq_len=16,
                    mesh="data=4,tensor=2", strategy="fsdp_tp", steps=4, lr=1e-2,
                    lr_warmup_steps=1, lr_decay_steps=4, seed=5, eval_batches=0, progress=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
