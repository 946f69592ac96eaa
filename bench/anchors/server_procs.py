"""The server anchor's processes (bench/anchors/server_anchor.py): finding llama-server, edgespec
and the target; one server at a time on a free loopback port (started, waited for, stopped, its log
kept); a chat request; the environment a result records."""

from __future__ import annotations

import glob
import os
import platform
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
BIN_NAME = "llama-server"


def log(msg: str) -> None:
    print(f"[server-anchor] {msg}", file=sys.stderr, flush=True)


class AnchorError(Exception):
    """A one-line error for the user (main prints it and exits 1)."""


def find_llama_server(explicit: str | None) -> str:
    if explicit:
        p = Path(explicit).expanduser()
        if not (p.is_file() and os.access(p, os.X_OK)):
            raise AnchorError(f"not an executable: {p}")
        return str(p)
    if os.environ.get("EDGESPEC_LLAMA_SERVER_BIN"):
        return find_llama_server(os.environ["EDGESPEC_LLAMA_SERVER_BIN"])
    home = Path(os.environ.get("EDGESPEC_HOME", Path.home() / ".cache" / "edgespec")).expanduser()
    hits = sorted(glob.glob(str(home / "anchors" / "build-*" / "bin" / BIN_NAME)))
    if not hits:
        raise AnchorError(f"{BIN_NAME} not found under {home / 'anchors'}: run `bench/anchors/build.sh llama-server` "
                          "(or pass --bin)")
    return hits[-1]


def find_edgespec(explicit: str | None) -> list[str]:
    if explicit:
        return shlex.split(explicit)
    venv = REPO / ".venv" / "bin" / "edgespec"
    if venv.is_file():
        return [str(venv)]
    found = shutil.which("edgespec")
    if found:
        return [found]
    raise AnchorError("edgespec command not found: run `make install` (or pass --edgespec-bin)")


def resolve_target(target: str) -> str:
    p = Path(target).expanduser()
    if p.is_file():
        return str(p.resolve())
    home = Path(os.environ.get("EDGESPEC_HOME", Path.home() / ".cache" / "edgespec")).expanduser() / "models"
    if (home / target).is_file():
        return str((home / target).resolve())
    try:
        from edgespec.models import resolve_model
        return str(resolve_model(target).resolve())
    except Exception:  # noqa: BLE001 - any failure is "not found" here
        raise AnchorError(f"model not found: {target} (a GGUF path, a file in {home}, or an edgespec model "
                          "name; `edgespec models fetch` gets the known ones)") from None


# -- servers ----------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, n: int = 20) -> str:
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-n:])


class Server:
    """One server process: started, waited for (/health answers 200), stopped. Never two at once."""

    running: Server | None = None

    def __init__(self, name: str, cmd: list[str], port: int, log_path: Path, start_timeout: float) -> None:
        self.name, self.cmd, self.port, self.log_path, self.start_timeout = name, cmd, port, log_path, start_timeout
        self.proc: subprocess.Popen | None = None
        self.ready_s = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Server:
        if Server.running is not None:
            raise AnchorError(f"{Server.running.name} is still running: servers run one at a time")
        t0 = time.perf_counter()
        with open(self.log_path, "wb") as out:
            try:
                self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             start_new_session=True)
            except OSError as e:
                raise AnchorError(f"{self.name}: cannot start {self.cmd[0]}: {e}") from None
        Server.running = self
        try:
            self._wait_ready(t0)
        except BaseException:
            self.stop()
            raise
        self.ready_s = time.perf_counter() - t0
        return self

    def _wait_ready(self, t0: float) -> None:
        assert self.proc is not None
        while True:
            code = self.proc.poll()
            if code is not None:
                print(log_tail(self.log_path), file=sys.stderr)
                raise AnchorError(f"{self.name} failed to start (exit code {code}; the last lines of its log "
                                  f"{self.log_path} are above)")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.perf_counter() - t0 > self.start_timeout:
                print(log_tail(self.log_path), file=sys.stderr)
                raise AnchorError(f"{self.name} did not answer {self.url}/health within {self.start_timeout:.0f} s "
                                  f"(the last lines of its log {self.log_path} are above)")
            time.sleep(0.25)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGINT if self.cmd and "edgespec" in Path(self.cmd[0]).name else signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
        if Server.running is self:
            Server.running = None

    def __exit__(self, *exc: object) -> None:
        self.stop()


def ask(client: Any, messages: list[dict[str, str]], max_tokens: int) -> tuple[dict[str, Any], float]:
    """One greedy non-streamed chat completion: (the response as a dict, client wall seconds)."""
    t0 = time.perf_counter()
    resp = client.chat.completions.create(model="target", messages=messages, max_tokens=max_tokens, temperature=0.0)
    return resp.model_dump(), time.perf_counter() - t0


# -- environment ------------------------------------------------------------------------------------


def run_text(cmd: Sequence[str], timeout: float = 30) -> str:
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"({e})"
    return p.stdout.decode("utf-8", "replace")


def environment(llama_bin: str | None, target: str) -> dict[str, Any]:
    """The run's machine and software, with its provenance (commit, date, CPU model:
    edgespec.bench.provenance); edgespec_commit is the full hash."""
    from edgespec.bench.provenance import provenance

    try:
        import llama_cpp
        llama_cpp_version = llama_cpp.__version__
    except Exception:  # noqa: BLE001
        llama_cpp_version = None
    commit = run_text(["git", "-C", str(REPO), "rev-parse", "HEAD"]).strip()
    dirty = bool(run_text(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"]).strip())
    env = {**provenance(REPO), "platform": platform.platform(), "cpus": os.cpu_count(),
           "python": platform.python_version(), "llama_cpp_python": llama_cpp_version,
           "edgespec_commit": commit, "edgespec_dirty": dirty, "target": target,
           "target_bytes": Path(target).stat().st_size, "loadavg_start": os.getloadavg()}
    if llama_bin:
        env["llama_server"] = llama_bin
        env["llama_server_version"] = run_text([llama_bin, "--version"]).strip().splitlines()[-2:]
    return env
