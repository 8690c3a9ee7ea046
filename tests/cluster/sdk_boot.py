"""A Python SDK worker's boot, as Beam's container boot does it, for workers started by a
runner's PROCESS environment (``--environment_type=PROCESS --environment_config='{"command":
"<this, through a shell wrapper>"}'``): the runner starts it with ``--id`` and its
endpoints; it asks the provisioning service for the job's pipeline options, then runs
``python -m apache_beam.runners.worker.sdk_worker_main`` in the worker's own environment
(this interpreter's: the package installed from its wheel, no checkout on the path), in a
folder of its own, and waits for it. When the worker ends it records, in
``$BEAM_PREFIX_WORKER_REPORTS/<id>-<pid>.json``, the worker's peak memory (its maximum
resident set), its wall time and exit status: what `make test-flink` reports per worker.
SIGTERM and SIGINT are passed on to the worker.

Staged artifacts (``--setup_file``, ``--extra_package``) are not installed: a cluster
worker built for this test has its packages already (the Flink test checks that none were
staged).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--id", required=True)
    parser.add_argument("--provision_endpoint", required=True)
    parser.add_argument("--logging_endpoint")
    parser.add_argument("--artifact_endpoint")
    parser.add_argument("--control_endpoint")
    parser.add_argument("--semi_persist_dir")
    args, _ = parser.parse_known_args(argv)

    import grpc
    from apache_beam.portability.api import beam_provision_api_pb2, beam_provision_api_pb2_grpc, endpoints_pb2
    from google.protobuf import json_format, text_format

    with grpc.insecure_channel(args.provision_endpoint) as channel:
        info = beam_provision_api_pb2_grpc.ProvisionServiceStub(channel).GetProvisionInfo(
            beam_provision_api_pb2.GetProvisionInfoRequest(), metadata=[("worker_id", args.id)]).info
    if len(info.dependencies) > 1:  # (the pickled pipeline options are not an artifact; a package would be)
        print(f"sdk_boot: {len(info.dependencies)} staged artifacts, which this boot does not install",
              file=sys.stderr)

    def descriptor(url: str) -> str:
        return text_format.MessageToString(endpoints_pb2.ApiServiceDescriptor(url=url))

    work = args.semi_persist_dir or tempfile.mkdtemp(prefix=f"beam-worker-{args.id}-")
    env = dict(os.environ, WORKER_ID=args.id, SEMI_PERSISTENT_DIRECTORY=work,
               PIPELINE_OPTIONS=json_format.MessageToJson(info.pipeline_options),
               LOGGING_API_SERVICE_DESCRIPTOR=descriptor(args.logging_endpoint or info.logging_endpoint.url),
               CONTROL_API_SERVICE_DESCRIPTOR=descriptor(args.control_endpoint or info.control_endpoint.url),
               RUNNER_CAPABILITIES=" ".join(info.runner_capabilities))
    if info.status_endpoint.url:
        env["STATUS_API_SERVICE_DESCRIPTOR"] = descriptor(info.status_endpoint.url)
    env.pop("PYTHONPATH", None)  # the worker's own environment only
    start = time.monotonic()
    worker = subprocess.Popen([sys.executable, "-m", "apache_beam.runners.worker.sdk_worker_main"], env=env, cwd=work)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: worker.send_signal(signum))
    status = worker.wait()
    reports = os.environ.get("BEAM_PREFIX_WORKER_REPORTS")
    if reports:
        os.makedirs(reports, exist_ok=True)
        with open(os.path.join(reports, f"{args.id}-{worker.pid}.json"), "w", encoding="utf-8") as f:
            json.dump({"worker_id": args.id, "pid": worker.pid, "status": status,
                       "seconds": round(time.monotonic() - start, 1),
                       "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1)}, f)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
