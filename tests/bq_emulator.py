"""Start and stop the `bqemulator` BigQuery emulator (PyPI, DuckDB-backed) on 127.0.0.1.

It runs from its own virtual environment (`make test` builds `.venv-bq`; or set
``BQEMULATOR`` to its executable). DuckDB would download its `spatial` extension at start
and fails offline, so the extension files shipped in the `duckdb-extension-*` wheels are
linked where DuckDB looks for them, under a private HOME.
"""

from __future__ import annotations

import glob
import os
import pathlib
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROJECT = "test-project"


def executable() -> str | None:
    path = os.environ.get("BQEMULATOR") or str(ROOT / ".venv-bq" / "bin" / "bqemulator")
    return path if os.path.exists(path) else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Emulator:
    """A running emulator: `rest` (http://127.0.0.1:P) and `grpc` (127.0.0.1:G)."""

    def __init__(self, exe: str):
        self.home = tempfile.mkdtemp(prefix="bqemulator-home-")
        site = glob.glob(os.path.join(os.path.dirname(os.path.dirname(exe)), "lib", "python*", "site-packages"))
        ext_dir = os.path.join(self.home, ".duckdb", "extensions")
        for ext in glob.glob(os.path.join(site[0], "duckdb_extension_*", "extensions", "v*", "*.duckdb_extension")):
            version = os.path.basename(os.path.dirname(ext))
            target = os.path.join(ext_dir, version, "linux_amd64")
            os.makedirs(target, exist_ok=True)
            os.symlink(ext, os.path.join(target, os.path.basename(ext)))
        rest_port, grpc_port = _free_port(), _free_port()
        self.rest, self.grpc = f"http://127.0.0.1:{rest_port}", f"127.0.0.1:{grpc_port}"
        env = {**os.environ, "HOME": self.home}
        self.log = open(os.path.join(self.home, "emulator.log"), "w")
        self.process = subprocess.Popen(
            [exe, "start", "--rest-host", "127.0.0.1", "--rest-port", str(rest_port), "--grpc-host",
             "127.0.0.1", "--grpc-port", str(grpc_port), "--project", PROJECT, "--log-level", "warning"],
            env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_ready()

    def _wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"bqemulator exited with {self.process.returncode}; see {self.log.name}")
            try:
                urllib.request.urlopen(f"{self.rest}/bigquery/v2/projects/{PROJECT}/datasets", timeout=2)
                return
            except OSError:
                time.sleep(0.2)
        self.stop(keep_home=True)
        raise RuntimeError(f"bqemulator did not answer within {timeout_s} s; see {self.log.name}")

    def client(self):
        from google.api_core.client_options import ClientOptions
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import bigquery

        return bigquery.Client(project=PROJECT, credentials=AnonymousCredentials(),
                               client_options=ClientOptions(api_endpoint=self.rest))

    def stop(self, *, keep_home: bool = False) -> None:
        """Stop the emulator and remove its home folder (`keep_home`: keep it, with the log
        a failure message points to)."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        if not keep_home:
            shutil.rmtree(self.home, ignore_errors=True)
