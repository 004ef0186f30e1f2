"""``RunConfig``'s fields as flags (``triax.cli.flags`` for the one config every run
command shares): ``triax train`` has them all, ``inspect`` and ``plan`` the ones they use;
their help is grouped by ``RunConfig``'s sections.

    >>> import argparse
    >>> p = argparse.ArgumentParser()
    >>> add_run_flags(p, ["steps", "precision", "progress"])
    >>> run_values(p.parse_args(["--steps", "3", "--no-progress"]))
    {'steps': 3, 'progress': False}
"""
from __future__ import annotations

import argparse

from triax.cli.flags import add_flags, given
from triax.configs import leaves, sections
# JAX-free (see training/config.py): the parser is built before the device count is set.
from triax.training.config import RunConfig

FIELDS = {name: leaf.field for name, leaf in leaves(RunConfig).items()}


def add_run_flags(p, names=None, defaults=None, notes=None, fill: bool = False,
                  aliases=None) -> None:
    """``add_flags`` for ``RunConfig``, the help grouped by its sections (on a parser; into
    a group, such as a mutually exclusive one, they go as they are)."""
    wanted = list(FIELDS if names is None else names)
    if not isinstance(p, argparse.ArgumentParser):
        add_flags(p, RunConfig, wanted, defaults, notes, fill, aliases)
        return
    for section, cls in sections(RunConfig).items():
        mine = [n for n in wanted if n in leaves(cls)]
        if mine:
            doc = " ".join((cls.__doc__ or "").replace("``", "").split())
            g = p.add_argument_group(section, doc.split(". ")[0].rstrip("."))   # 1st sentence
            add_flags(g, RunConfig, mine, defaults, notes, fill, aliases)


def run_values(args: argparse.Namespace) -> dict:
    """The ``RunConfig`` fields given on the command line."""
    return given(args, RunConfig)
