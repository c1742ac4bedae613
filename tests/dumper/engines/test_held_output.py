"""What an engine's processes print to stderr, held (:mod:`dumper.engines.held_output`), without an engine.

A child process started inside :func:`held_stderr` stands for an engine's process: it writes a line to its
stderr whenever it is told to and then says so on stdout. In a script of its own (fd 2 a file, so that it can
wait for what passes through): the start's output is written out after the start, the run's passes through,
and a later block given the start's relay holds it again. When that block fails (an engine that died, shut
down inside the block) everything the child prints from then on is dropped with it, however late it comes;
under ``DRIFTSCOPE_DEBUG=1``, and after a block that succeeds, it is written out after the block.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

SCRIPT = r"""
import os, subprocess, sys, tempfile, threading, time
from dumper.engines.held_output import held_stderr

log = tempfile.NamedTemporaryFile(delete=False)
os.dup2(log.fileno(), 2)  # the terminal: a file this script can read back
CHILD = "import sys\nfor line in sys.stdin:\n    sys.stderr.write(line); sys.stderr.flush(); print(flush=True)"


def say(text):  # the engine's process writes a line to its stderr
    child.stdin.write(text + "\n"); child.stdin.flush(); child.stdout.readline()


def shown(text):  # wait for a line the relay passes through
    while text not in open(log.name).read():
        time.sleep(0.01)


with held_stderr() as engine:
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    say("engine: started")
shown("engine: started")
say("engine: running")
shown("engine: running")
try:
    with held_stderr(engine):
        say("engine: failing")
        sys.stderr.write("client: failing\n")  # one write: the relays keep whole writes apart
        if sys.argv[1] == "fail":
            raise RuntimeError
except RuntimeError:
    pass
say("engine: stopped")
print("error: one line", file=sys.stderr, flush=True)
child.stdin.close(); child.wait()
while any(t.name == "driftscope-held-stderr" for t in threading.enumerate()):  # every relay read to its end
    time.sleep(0.01)
sys.stdout.write(open(log.name).read())
"""


@pytest.mark.parametrize(("run", "debug"), [("fail", ""), ("fail", "1"), ("ok", "")])
def test_a_failed_block_drops_what_the_engine_prints_from_then_on(run, debug):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DRIFTSCOPE_DEBUG": debug}
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT, run], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    if run == "fail" and not debug:
        assert lines == ["engine: started", "engine: running", "error: one line"], lines
        return
    # written out after the block, then passed as it comes: in no fixed order after the first two
    assert lines[:2] == ["engine: started", "engine: running"], lines
    assert sorted(lines[2:]) == ["client: failing", "engine: failing", "engine: stopped", "error: one line"], lines
