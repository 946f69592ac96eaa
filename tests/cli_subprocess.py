"""The CLI run in a fresh interpreter where one optional dependency cannot be imported, as on a machine
without its extra (llama_cpp: the llama extra; torch: train)."""

from __future__ import annotations

import subprocess
import sys

_SCRIPT = """
import importlib.abc, sys
BLOCKED = sys.argv.pop(1)
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == BLOCKED or name.startswith(BLOCKED + "."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Blocker())
sys.argv = ["edgespec", *sys.argv[1:]]
from edgespec.cli.app import main
try:
    main()
finally:
    assert BLOCKED not in sys.modules
"""


def run_cli_without(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`edgespec *args` in a new interpreter in which importing `module` (or a submodule) fails."""
    return subprocess.run([sys.executable, "-c", _SCRIPT, module, *args], capture_output=True, text=True, timeout=60)
