"""triax: one model, many devices.

A JAX/XLA SPMD framework: parameters and activations carry logical axis names, one rules
table maps them onto a ``data × tensor × pipe (× expert)`` mesh, and XLA inserts the
collectives. See README.md for the tour.
"""
__version__ = "0.1.0"
