"""The small training runs several test files train, as ``RunConfig`` fields: files that
train the same run compile the same step, init and checksum programs, so in the suite (one
persistent compilation cache for every worker and child) the second file's are cache hits.
Anything that enters the compiled step (model, mesh, strategy, the learning-rate schedule's
constants) is fixed here; seeds, step counts and checkpointing stay each file's own."""

_TINY = dict(model="tiny", data="markov", batch_size=8, seq_len=16, mesh="data=8", lr=1e-2,
             lr_warmup_steps=1, eval_batches=0)
# One layer, replicated: test_training_disk_full, test_training_nonfinite,
# test_preflight_checks.
DP = dict(_TINY, num_layers=1, strategy="dp", lr_decay_steps=100)
# Two layers (the resharded resume splits them over pipe=2), sharded over data:
# test_training_checkpoint, test_checkpoint_integrity.
FSDP = dict(_TINY, num_layers=2, strategy="fsdp", lr_decay_steps=6)
