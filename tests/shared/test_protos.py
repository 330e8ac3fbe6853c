import subprocess
import sys

from tests.support import ROOT


def test_generated_stubs_are_current():
    r = subprocess.run([sys.executable, "scripts/gen_protos.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
