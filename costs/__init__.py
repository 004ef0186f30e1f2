"""The analytic model: what a run needs where, without running it. Below training and
inference, which ask it (the fits check, ``--pipeline-fsdp auto``); the planner's search
above ranks layouts with it.

``workload.py`` (what is planned, how it is laid out: ``Workload``, ``Layout``), ``memory.py``
(bytes per device, term by term), ``activations.py``, ``param_layout.py`` (the real parameter
tree, placed), ``comm.py`` (collective traffic), ``pipeline_math.py`` (bubbles, in-flight
micro-batches), ``hardware.py`` (the catalogue), ``fits.py`` (a need against a device's
memory). Nothing is imported here, so ``costs.fits`` loads without JAX; the public names are
``triax.planner``'s (docs/api.md).
"""
