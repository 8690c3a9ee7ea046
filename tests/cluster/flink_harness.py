"""A real Flink for `make test-flink`: Beam's Flink job server (its classpath from
tests/cluster/pom.xml), Flink embedded in it or a standalone cluster of separate JobManager
and TaskManager processes (Flink's own jars, from the ``apache-flink-libraries`` sdist), and
Python SDK workers as separate processes (the PROCESS environment, `sdk_boot.py`), in a
worker environment built as a cluster's would be: the package installed from its wheel,
no checkout on the path, no embedded model and a model cache of their own.

The Makefile prepares ``.flink/`` (``lib/``: the job server; ``flink-1.19.3/``: Flink's
jars) and ``.venv-flink`` (the wheel and the lowest Beam of setup.py's range, which is
the job server's), and runs ``pytest -m flink tests/cluster`` with
``BEAM_PREFIX_FLINK_HOME`` naming ``.flink`` and ``-p flink_harness`` (this module as a
plugin: its end-of-run summary prints rows/s and each worker's peak memory, and writes them to
``BEAM_PREFIX_FLINK_RESULTS``). Without it, the tests are skipped.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
HOME = os.environ.get("BEAM_PREFIX_FLINK_HOME")
VENV = pathlib.Path(os.environ.get("BEAM_PREFIX_FLINK_VENV", ROOT / ".venv-flink"))
FLINK_VERSION = "1.19.3"
_MEASURED: list[dict] = []  # one entry per Flink run: printed at the end, and written as results
# Flink restarts a failed task (a killed SDK worker, a lost TaskManager) up to 3 times, 2 s apart
# (its default without checkpointing is not to restart a batch job at all)
RESTARTS = "restart-strategy.type: fixed-delay\nrestart-strategy.fixed-delay.attempts: 3\n" \
           "restart-strategy.fixed-delay.delay: 2 s\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _clean_env(**more) -> dict:
    """This process's environment without the checkout on the path or the tests' settings."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "BEAM_PREFIX_CACHE", "PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT")
           and not k.startswith("PYTEST_")}
    env.update(more)
    return env


def _wait(predicate, seconds: float, what: str, proc: subprocess.Popen | None = None, log: pathlib.Path | None = None):
    deadline = time.monotonic() + seconds
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: the process ended ({proc.returncode}); {log.read_text()[-3000:] if log else ''}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not ready in {seconds:g} s; {log.read_text()[-3000:] if log else ''}")
        time.sleep(0.5)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def job_server(work: pathlib.Path, flink_master: str):
    """Beam's Flink job server; yields its job endpoint."""
    ports = {name: free_port() for name in ("job", "artifact", "expansion")}
    log = work / f"job-server-{ports['job']}.log"
    conf = work / f"job-server-{ports['job']}-conf"  # set on every job it submits
    conf.mkdir()
    (conf / "config.yaml").write_text(RESTARTS)
    cmd = ["java", "-cp", f"{HOME}/lib/*", "org.apache.beam.runners.flink.FlinkJobServerDriver",
           f"--flink-master={flink_master}", f"--job-port={ports['job']}", f"--artifact-port={ports['artifact']}",
           f"--expansion-port={ports['expansion']}", f"--flink-conf-dir={conf}"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=work, env=_clean_env(),
                                start_new_session=True)
    try:
        _wait(lambda: "JobService started" in log.read_text(), 120, "the Flink job server", proc, log)
        yield f"localhost:{ports['job']}", proc
    finally:
        _stop(proc)


@contextlib.contextmanager
def standalone_cluster(work: pathlib.Path, slots: int = 2):
    """A Flink session cluster: a JobManager and a TaskManager, each its own JVM (as Flink's
    bin scripts start them); yields the REST address."""
    dist = pathlib.Path(HOME) / f"flink-{FLINK_VERSION}"
    conf = work / "flink-conf"
    conf.mkdir(exist_ok=True)
    rest, rpc = free_port(), free_port()
    (conf / "config.yaml").write_text(f"""\
jobmanager:
  rpc: {{address: localhost, port: {rpc}}}
  bind-host: localhost
  memory: {{process: {{size: 1024m}}}}
taskmanager:
  bind-host: localhost
  host: localhost
  numberOfTaskSlots: {slots}
  memory: {{process: {{size: 2048m}}, network: {{min: 256mb, max: 256mb}}}}
rest: {{port: {rest}, address: localhost, bind-address: localhost}}
parallelism: {{default: {slots}}}
""" + RESTARTS)
    classpath = f"{dist}/lib/*"
    procs = []
    try:
        with open(work / "jobmanager.log", "w") as out:
            procs.append(subprocess.Popen(
                ["java", "-Xmx512m", "-cp", classpath,
                 "org.apache.flink.runtime.entrypoint.StandaloneSessionClusterEntrypoint", "--configDir", str(conf)],
                stdout=out, stderr=subprocess.STDOUT, env=_clean_env(), start_new_session=True))
        # the TaskManager's JVM and memory settings as Flink's taskmanager.sh derives them
        derived = subprocess.run(["java", "-cp", f"{dist}/bin/bash-java-utils.jar:{classpath}",
                                  "org.apache.flink.runtime.util.bash.BashJavaUtils", "GET_TM_RESOURCE_PARAMS",
                                  "--configDir", str(conf)], capture_output=True, text=True, check=True).stdout
        jvm, dynamic = [line.split(":", 1)[1].split() for line in derived.splitlines()
                        if line.startswith("BASH_JAVA_UTILS_EXEC_RESULT:")][-2:]
        with open(work / "taskmanager.log", "w") as out:
            procs.append(subprocess.Popen(
                ["java", *jvm, "-cp", classpath, "org.apache.flink.runtime.taskexecutor.TaskManagerRunner",
                 "--configDir", str(conf), *dynamic],
                stdout=out, stderr=subprocess.STDOUT, env=_clean_env(), start_new_session=True))

        def ready() -> bool:
            try:
                with urllib.request.urlopen(f"http://localhost:{rest}/overview", timeout=5) as r:
                    return json.load(r).get("taskmanagers") == 1
            except OSError:
                return False

        _wait(ready, 120, "the Flink cluster", procs[-1], work / "taskmanager.log")
        yield f"localhost:{rest}", procs
    finally:
        for proc in reversed(procs):
            _stop(proc)


class FlinkRunner:
    """Runs the package's CLIs (and scripts) with the worker environment's Python against one
    job server, with PROCESS workers, from a folder outside the checkout."""

    def __init__(self, endpoint: str, work: pathlib.Path, kind: str):
        self.endpoint, self.work, self.kind = endpoint, work, kind
        self.reports = work / "worker-reports"
        self.worker_cache = work / "worker-cache"  # the workers' own model cache: empty at first
        self.boot = work / "boot"
        self.boot.write_text(f'#!/bin/sh\nexec "{VENV}/bin/python" "{ROOT}/tests/cluster/sdk_boot.py" "$@"\n')
        self.boot.chmod(0o755)

    def flags(self, parallelism: int = 2, more_env: dict | None = None) -> list[str]:
        env = {"BEAM_PREFIX_CACHE": str(self.worker_cache), "BEAM_PREFIX_WORKER_REPORTS": str(self.reports),
               "HF_HUB_OFFLINE": "1", **(more_env or {})}
        return ["--runner=PortableRunner", f"--job_endpoint={self.endpoint}", "--environment_type=PROCESS",
                "--environment_config=" + json.dumps({"command": str(self.boot), "env": env}),
                f"--parallelism={parallelism}", f"--temp_location={self.work}/temp"]

    def run(self, argv: list[str], *, name: str, rows: int, timeout: float = 600, module: str | None = None,
            script: str | None = None, summary: str | None = None) -> subprocess.CompletedProcess:
        """Run a CLI module (or a script) in the worker environment; measures rows/s end to end
        and the peak memory of each worker process it started (and, from the run's `summary`
        JSON, the step's own rows/s over its model time, and its start-up)."""
        before = set(self.reports.glob("*.json")) if self.reports.exists() else set()
        cmd = [str(VENV / "bin" / "python"), *(["-m", module] if module else [script]), *argv]
        start = time.monotonic()
        proc = subprocess.run(cmd, cwd=self.work, env=_clean_env(), capture_output=True, text=True, timeout=timeout)
        wall = time.monotonic() - start
        workers = [json.loads(p.read_text()) for p in sorted(set(self.reports.glob("*.json")) - before)]
        _MEASURED.append({"run": name, "flink": self.kind, "rows": rows, "wall_s": round(wall, 1),
                          "rows_per_s": round(rows / wall, 2) if wall else None, "exit": proc.returncode,
                          "workers": [{"peak_rss_mb": w["peak_rss_mb"], "seconds": w["seconds"], "status": w["status"]}
                                      for w in workers]})
        if summary and os.path.exists(summary):
            with open(summary, encoding="utf-8") as f:
                said = json.load(f)
            _MEASURED[-1]["step"] = {"rows_read": said.get("rows_read"), "wall_s": said.get("wall_s"),
                                     **{f"model_{k}": v for k, v in (said.get("classification") or {}).items()},
                                     **{f"startup_{k}": v for k, v in (said.get("startup") or {}).items()}}
        return proc


def direct(argv: list[str], *, module: str | None, work: pathlib.Path, script: str | None = None
           ) -> subprocess.CompletedProcess:
    """The same CLI (or script) on the DirectRunner, in the project's own environment (its
    newest Beam, the embedded model installed), from the same folder outside the checkout."""
    what = ["-m", module] if module else [script]
    return subprocess.run([str(ROOT / ".venv" / "bin" / "python"), *what, "--runner=DirectRunner", *argv],
                          cwd=work, env=_clean_env(), capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="session")
def launcher_model():
    """The launcher's converted embedded model (the project's environment has the GGUF;
    the worker environment has not): its cache root, which the launcher stages from."""
    out = subprocess.run([str(ROOT / ".venv" / "bin" / "python"), "-c",
                          "from beam_prefix.model.loading import embedded_directory; print(embedded_directory())"],
                         capture_output=True, text=True, check=True, env=_clean_env()).stdout.strip()
    assert os.path.exists(os.path.join(out, "model.safetensors"))
    return out


@pytest.fixture(scope="module")
def embedded_flink(tmp_path_factory, launcher_model):
    """Flink embedded in the job server, at parallelism 2."""
    work = tmp_path_factory.mktemp("flink-embedded")
    with job_server(work, "[local]") as (endpoint, _):
        yield FlinkRunner(endpoint, work, "embedded in the job server")


@pytest.fixture(scope="module")
def cluster_flink(tmp_path_factory, launcher_model):
    """A standalone Flink cluster (JobManager and TaskManager processes) behind the job server."""
    work = tmp_path_factory.mktemp("flink-cluster")
    with standalone_cluster(work) as (rest, _), job_server(work, rest) as (endpoint, _):
        yield FlinkRunner(endpoint, work, "standalone: JobManager + TaskManager")


def pytest_terminal_summary(terminalreporter):
    if not _MEASURED:
        return
    terminalreporter.section("Flink runs (rows/s end to end, start-up included; each worker process's peak RSS)")
    for m in _MEASURED:
        peaks = ", ".join(f"{w['peak_rss_mb']:.0f} MB" for w in m["workers"]) or "-"
        terminalreporter.write_line(f"{m['run']:<38} {m['flink']:<36} {m['rows']:>5} rows {m['wall_s']:>6.1f} s "
                                    f"{m['rows_per_s'] or 0:>6.2f} rows/s  workers: {peaks}")
    target = os.environ.get("BEAM_PREFIX_FLINK_RESULTS")
    if target:
        with open(target, "w", encoding="utf-8") as f:
            json.dump({"flink": FLINK_VERSION, "beam": "2.70.0", "python": sys.version.split()[0],
                       "cpu_count": os.cpu_count(), "runs": _MEASURED}, f, indent=1)
        terminalreporter.write_line(f"written: {target}")


def kill_a_worker(after_s: float, alive_s: float) -> dict:
    """After `after_s`, kill -9 the first SDK worker process (`sdk_worker_main` in the worker
    environment) that has been running `alive_s` seconds (so mid-job, past its start-up),
    waiting up to a minute for one; returns its pid (empty: none ran)."""
    time.sleep(after_s)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for pid in sorted(int(p) for p in os.listdir("/proc") if p.isdigit()):
            try:
                cmd = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                age = time.time() - os.stat(f"/proc/{pid}").st_mtime
            except OSError:
                continue
            if b"apache_beam.runners.worker.sdk_worker_main" in cmd and cmd[0].startswith(str(VENV).encode()) \
                    and age >= alive_s:
                os.kill(pid, signal.SIGKILL)
                return {"pid": pid}
        time.sleep(0.5)
    return {}
