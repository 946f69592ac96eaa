"""edgespec.bench.provenance: every bench writer records the commit, the date and the CPU model."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from edgespec.bench import provenance, report
from edgespec.bench.run import environment

ROOT = Path(__file__).resolve().parents[1]


def test_commit_is_the_checkouts_head_and_unknown_outside_one(tmp_path):
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode == 0:  # an installed copy outside a checkout has no HEAD to compare with
        assert re.fullmatch(re.escape(head.stdout.strip()) + r"(\+dirty)?", provenance.commit(ROOT))
    assert provenance.commit(tmp_path) == "unknown"


def test_cpu_model_reads_proc_cpuinfo():
    cpu = provenance.cpu_model()
    assert cpu and cpu != "unknown" or not Path("/proc/cpuinfo").exists()
    info = Path("/proc/cpuinfo")
    names = [ln.split(":", 1)[1].strip() for ln in info.read_text().splitlines()
             if ln.startswith("model name")] if info.exists() else []
    if names:
        assert cpu == names[0]


def test_environment_and_results_md_header_carry_it():
    env = environment()
    assert {"commit", "date", "cpu"} <= set(env)
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", env["date"])
    meta = dict(command="edgespec bench", target="ref", threads=1, sha256={"ref": "0" * 64}, env=env)
    md = report.markdown(meta, [])
    assert f"commit {env['commit']} · {env['date']} · {env['cpu']}" in md
    old = dict(meta, env=dict(platform="p", machine="m", edgespec="0", llama_cpp="0", date="d"))
    assert "commit ? · d · ?" in report.markdown(old, [])  # a result written before provenance
