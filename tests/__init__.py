# The examples' helpers (a local cluster of real servers, the router) are what the tests
# drive; they import as top-level modules, as the example scripts import each other.
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
