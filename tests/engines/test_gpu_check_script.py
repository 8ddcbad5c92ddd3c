"""The GPU check script (scripts/gpu_check.py) runs its checks on CPU where there is no GPU, so
it cannot rot between the sessions that have one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"


def test_the_gpu_check_script_passes_on_this_machine():
    run = subprocess.run([sys.executable, str(SCRIPT)], check=False, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count(" ok ") == 6  # five page adapters, then the ordering
