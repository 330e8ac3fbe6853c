"""``shared.entry.end_process``: a service's exit does what a normal exit does — thread pools and
threads finish, ``atexit`` handlers run, output is flushed, the exit code is kept — without the
interpreter's teardown (where Triton's nanobind extension prints its "leaked" report)."""

from __future__ import annotations

import subprocess
import sys

from tests.support import ROOT

SCRIPT = """
import atexit, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from shared.entry import end_process

class TornDown:  # what the interpreter's teardown would finalize (as nanobind's leak check runs there)
    def __del__(self):
        print("torn down", flush=True)

keep = TornDown()
pool = ThreadPoolExecutor(2)
done = pool.submit(time.sleep, 0.2)
worker = threading.Thread(target=lambda: (time.sleep(0.3), print("thread finished")))
worker.start()
atexit.register(lambda: print("atexit ran"))
sys.stdout.write("unflushed output")
end_process(3)
"""


def test_end_process_is_a_normal_exit_without_teardown() -> None:
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env={"PYTHONPATH": str(ROOT)}, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 3, r.stderr[-2000:]
    assert "thread finished" in r.stdout and "atexit ran" in r.stdout and "unflushed output" in r.stdout, r.stdout
    assert "torn down" not in r.stdout, r.stdout
