"""The README's main job (scripts/demo.sh) installs kvbus[demo], not the test tools: what
it runs must not import them (a fresh machine's demo stopped at its second part on
``import redis``, pulled in through bench_fleet's imports)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Only the dev extras' packages: with them unimportable, the demo's scripts must start.
DEV_ONLY = ("redis", "hiredis", "pytest", "hypothesis")


def test_the_demos_scripts_start_without_the_test_tools() -> None:
    blocked = "; ".join(f"sys.modules[{name!r}] = None" for name in DEV_ONLY)
    for script in ("examples/router_demo.py", "bench/bench_fleet_routing.py"):
        code = (
            f"import runpy, sys; {blocked}; sys.argv = [{script!r}, '--help']; "
            f"sys.path.insert(0, {str((ROOT / script).parent)!r}); "  # as `python SCRIPT` does
            f"runpy.run_path({script!r}, run_name='__main__')"
        )
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0 and "usage:" in done.stdout, (script, done.stderr[-2000:])
