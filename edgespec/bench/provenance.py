"""Where a result came from: the commit, the date and the CPU model, recorded by every bench writer
(`edgespec bench`'s results.json and results.md, bench/*.py, bench/anchors/*.py), so a number can be
traced to the code and the machine that measured it."""

from __future__ import annotations

import platform
import subprocess
import time
from pathlib import Path


def commit(where: Path | None = None) -> str:
    """The checkout's short commit (`git rev-parse --short HEAD` in `where`, default this package's
    folder), with "+dirty" when tracked files differ from it; "unknown" outside a checkout."""
    cwd = where or Path(__file__).resolve().parent

    def git(*args: str) -> subprocess.CompletedProcess | None:
        try:
            return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None

    head = git("rev-parse", "--short", "HEAD")
    if head is None or head.returncode != 0 or not head.stdout.strip():
        return "unknown"
    status = git("status", "--porcelain", "--untracked-files=no")
    dirty = status is not None and status.returncode == 0 and bool(status.stdout.strip())
    return head.stdout.strip() + ("+dirty" if dirty else "")


def cpu_model() -> str:
    """The CPU's model name: /proc/cpuinfo's `model name` (Linux), `sysctl machdep.cpu.brand_string`
    (macOS), else platform.processor() or the machine type."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if platform.system() == "Darwin":
        try:
            out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                 timeout=10)
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine() or "unknown"


def provenance(where: Path | None = None) -> dict:
    """{commit, date, cpu}: the commit (see `commit`), the local date and time, the CPU model."""
    return dict(commit=commit(where), date=time.strftime("%Y-%m-%d %H:%M:%S %z"), cpu=cpu_model())


def line(prov: dict) -> str:
    """One line for a results.md header: "commit abc1234 · 2026-12-05 10:00:00 +0000 · <CPU model>"
    ("?" for a field an older result lacks)."""
    return f"commit {prov.get('commit', '?')} · {prov.get('date', '?')} · {prov.get('cpu', '?')}"
