"""Every shell example in the README and ``docs/`` works as written on the default devices.

The suite checks each ``triax`` command the way the CLI first reads it: the parser takes its
flags, the command's config is built and validated (``RunConfig``, ``ServeConfig``, with
their inert-flag warnings as errors), and its mesh fits the devices the command would see.
Each block is either run or marked with why not (``tests/doc_commands.py`` has the markers).

Running every block for real costs about 6 minutes (train, generate and serve each compile),
more than the suite's budget allows, so it is one command away:
``TRIAX_DOC_COMMANDS=run .venv/bin/python -m pytest tests/test_docs_commands.py -k run``
runs each block with bash in a scratch folder, a ``serve`` block in the background until its
page's ``curl`` blocks have run against it.
"""
from __future__ import annotations

import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from doc_commands import ROOT, blocks, shortened, triax_argv

from triax.cli.main import build_parser
from triax.mesh.build import parse_mesh

BLOCKS = blocks()
COMMANDS = [(b, c, triax_argv(c)) for b in BLOCKS if b.marker != "skip" for c in b.commands()]
RUN = os.environ.get("TRIAX_DOC_COMMANDS") == "run"
DEVICES = 8   # the simulated CPU devices every command starts on here


def test_every_block_runs_or_says_why_not():
    assert len(BLOCKS) >= 15, "the docs' shell examples were not found"
    for b in BLOCKS:
        assert b.commands(), f"{b.where}: an empty shell block"
        if b.marker == "skip":
            assert len(b.why) > 10, f"{b.where}: a skipped block must say why"
        else:
            assert not any(c.startswith("#SBATCH") for c in b.lines), \
                f"{b.where}: a batch script cannot run here; mark it skipped, saying why"


def _devices_for(command: str) -> int:
    m = re.search(r"\bJAX_NUM_CPU_DEVICES=(\d+)", command)
    return int(m.group(1)) if m else DEVICES


def _fits(where: str, sizes: dict, replicas, devices: int) -> None:
    per = math.prod(sizes.values()) if sizes else 1
    if -1 in sizes.values():
        return
    n = per * (replicas or (devices // per if sizes else 1))
    assert n <= devices, (f"{where}: the mesh {sizes} × {replicas or 'default'} replica(s) "
                          f"needs {n} devices; the command sees {devices}")


@pytest.mark.parametrize("block,command,argv", [c for c in COMMANDS if c[2] is not None],
                         ids=lambda v: v.where if hasattr(v, "where") else "")
def test_command_parses_and_validates(block, command, argv):
    from triax.cli.serving_flags import serve_config
    from triax.cli.train_cmd import run_config_and_given
    argv = shortened(argv, port=0) if block.marker == "short" else argv
    try:
        args = build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{block.where}: `triax {' '.join(argv)}` is refused by the parser")
    devices = _devices_for(command)
    with warnings.catch_warnings():
        warnings.simplefilter("error")     # a flag the command ignores is a docs bug
        if args.command == "train":
            run, _ = run_config_and_given(args)
            if run.plan != "auto":
                _fits(block.where, parse_mesh(run.mesh) if run.mesh else {}, None, devices)
        elif args.command in ("generate", "serve"):
            config = serve_config(args)
            lay = config.layout
            if lay.plan != "auto" and lay.mesh:
                _fits(block.where, lay.mesh_sizes(), lay.replicas, devices)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _steps(page: str, port: int):
    """The page's commands in order, each a bash script: a ``short`` block's shortened, a
    command ending in ``&`` joined with the next (they run together), ``localhost:8000``
    the page's server."""
    pending = []
    for b in [b for b in BLOCKS if b.page == page and b.marker != "skip"]:
        for command in b.commands():
            argv = triax_argv(command)
            if argv is not None and b.marker == "short":
                command = re.sub(r"\btriax\b.*?(?=(\s+&)?$)",
                                 lambda _: "triax " + shlex.join(shortened(argv, port)),
                                 command.split(" #")[0].rstrip(), count=1)
            command = command.replace("localhost:8000", f"127.0.0.1:{port}")
            pending.append(command)
            if not command.endswith("&"):
                yield b, argv, "\n".join(pending + ["wait"])
                pending = []


def _start_server(where, script, env, cwd):
    proc = subprocess.Popen(["bash", "-c", "exec " + script.split("\nwait")[0]], env=env,
                            cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "ready at http" in line:
            return proc
    proc.wait(timeout=10)
    pytest.fail(f"{where}: the server exited ({proc.returncode}) before it was ready:\n"
                + "".join(seen[-20:]))


@pytest.mark.skipif(not RUN, reason="the full run costs minutes: TRIAX_DOC_COMMANDS=run")
@pytest.mark.parametrize("page", sorted({b.page for b in BLOCKS}))
def test_run_every_block_of(page, tmp_path):
    """Each command of ``page`` in order, with bash in one scratch folder (``tests/`` linked
    in for the fixtures); a ``serve`` stays up for the page's later commands."""
    (tmp_path / "tests").symlink_to(ROOT / "tests")
    (tmp_path / ".ci").symlink_to(ROOT / ".ci")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env.pop("JAX_NUM_CPU_DEVICES", None)     # the commands start as a reader's would
    port, server = _free_port(), None
    try:
        for b, argv, script in _steps(page, port):
            if argv and argv[0] == "serve":
                assert server is None, f"{b.where}: a page may start one server"
                server = _start_server(b.where, script, env, tmp_path)
                continue
            done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], env=env,
                                  cwd=tmp_path, capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, (f"{b.where}: `{script}` failed "
                                          f"({done.returncode}):\n{done.stdout[-2000:]}\n"
                                          f"{done.stderr[-3000:]}")
    finally:
        if server is not None:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=60)
