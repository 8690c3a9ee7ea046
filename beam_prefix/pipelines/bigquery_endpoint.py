"""Point Beam's BigQuery IO at another endpoint (a local emulator); inert when none is set.

Beam's BigQuery connectors have no endpoint option. Three clients must be redirected:
the apitools ``BigqueryV2`` client (fixed base URL), the Storage Read API client (built
with no arguments) and ``google.cloud.bigquery.Client`` (default credentials). `install`
redirects all three, with no credentials, and records the endpoint in an environment
variable so that worker processes started from this one redirect theirs when they import
this module: pass ``--beam_plugins=beam_prefix.pipelines.bigquery_endpoint`` (the classify pipeline
does this whenever ``--bigquery_endpoint`` is given). Production runs never call it and
use Beam's connectors untouched.

One more fix rides along: BigQuery's ``datasets.list`` honours a label filter, some
emulators ignore it, and Beam's DIRECT_READ clean-up deletes every dataset the filtered
list returns. The redirected client applies the label filter itself, so only Beam's
labelled temporary datasets can be deleted. Two emulator gaps are bridged the same way:
an EXPORT read to a local location gets its directory created first, and a query job's
destination table (ignored by the emulator) is written as ``CREATE OR REPLACE TABLE ... AS``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import types

__all__ = ["Endpoint", "install", "uninstall", "installed", "ENV_VAR"]

_LOGGER = logging.getLogger(__name__)

ENV_VAR = "BEAM_PREFIX_BIGQUERY_ENDPOINT"
_ORIGINALS: dict = {}
_CURRENT: "Endpoint | None" = None


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """Where BigQuery lives.

    Args:
        rest: base URL of the REST API, e.g. ``http://127.0.0.1:9050``.
        grpc: ``host:port`` of the Storage Read/Write gRPC API (plain-text channel).
        project: project used by clients built without one.
    """

    rest: str
    grpc: str | None = None
    project: str | None = None

    def __post_init__(self):
        if not re.match(r"^https?://[^/\s]+/?$", self.rest or ""):
            raise ValueError(f"--bigquery_endpoint must look like http://HOST:PORT, got {self.rest!r}")
        if self.grpc is not None and not re.match(r"^[^\s/:]+:\d+$", self.grpc):
            raise ValueError(f"--bigquery_storage_endpoint must look like HOST:PORT, got {self.grpc!r}")


def installed() -> "Endpoint | None":
    """The endpoint Beam's BigQuery IO is pointed at in this process, if any."""
    return _CURRENT


def install(endpoint: Endpoint) -> None:
    """Redirect Beam's BigQuery clients in this process (and, via the environment, in
    worker processes that import this module) to `endpoint`, with no credentials."""
    global _CURRENT
    from apache_beam.io.gcp import bigquery as beam_bigquery
    from apache_beam.io.gcp import bigquery_tools

    if not _ORIGINALS:
        _ORIGINALS.update(client=bigquery_tools.BigQueryWrapper.__dict__["_bigquery_client"],
                          gcp_bigquery=bigquery_tools.gcp_bigquery,
                          bq_storage=getattr(beam_bigquery, "bq_storage", None))
    bigquery_tools.BigQueryWrapper._bigquery_client = staticmethod(lambda options: _apitools_client(endpoint))
    bigquery_tools.gcp_bigquery = _module_with(_ORIGINALS["gcp_bigquery"],
                                               Client=lambda *a, **kw: _cloud_client(endpoint))
    if _ORIGINALS["bq_storage"] is not None:
        beam_bigquery.bq_storage = _module_with(_ORIGINALS["bq_storage"],
                                                BigQueryReadClient=lambda *a, **kw: _read_client(endpoint))
    os.environ[ENV_VAR] = json.dumps(dataclasses.asdict(endpoint))
    # worker processes must not wait on GCE metadata discovery
    os.environ.setdefault("NO_GCE_CHECK", "true")
    _CURRENT = endpoint
    _LOGGER.info("Beam BigQuery IO redirected to %s (storage %s)", endpoint.rest, endpoint.grpc)


def uninstall() -> None:
    """Undo `install` in this process."""
    global _CURRENT
    if _ORIGINALS:
        from apache_beam.io.gcp import bigquery as beam_bigquery
        from apache_beam.io.gcp import bigquery_tools

        bigquery_tools.BigQueryWrapper._bigquery_client = _ORIGINALS["client"]
        bigquery_tools.gcp_bigquery = _ORIGINALS["gcp_bigquery"]
        if _ORIGINALS["bq_storage"] is not None:
            beam_bigquery.bq_storage = _ORIGINALS["bq_storage"]
    os.environ.pop(ENV_VAR, None)
    _CURRENT = None


def _module_with(module, **overrides):
    """A stand-in for `module` with some attributes replaced (the real module is untouched,
    so code outside Beam's BigQuery IO keeps the real clients)."""
    class _Proxy(types.ModuleType):
        def __getattr__(self, name):
            return getattr(module, name)

    stand_in = _Proxy(module.__name__)
    stand_in.__dict__.update(overrides)
    return stand_in


def _apitools_client(endpoint: Endpoint):
    from apache_beam.internal.http_client import get_new_http
    from apache_beam.io.gcp.internal.clients import bigquery

    client = bigquery.BigqueryV2(url=endpoint.rest.rstrip("/") + "/bigquery/v2/", get_credentials=False,
                                 http=get_new_http(), response_encoding="utf8")
    original_list = client.datasets.List

    def list_with_label_filter(request, global_params=None):
        response = original_list(request, global_params=global_params)
        wanted = _labels_in_filter(request.filter)
        if wanted:
            response.datasets = [d for d in response.datasets if _has_labels(client, d, wanted)]
        return response

    original_insert = client.jobs.Insert

    def insert_job(request, *args, **kwargs):
        config = request.job.configuration if request.job else None
        extract = config.extract if config else None
        for uri in (extract.destinationUris if extract else []):
            if "://" not in uri:  # a local export location: the emulator does not create it
                os.makedirs(os.path.dirname(uri), exist_ok=True)
        query = config.query if config else None
        if query is not None and query.destinationTable is not None and not config.dryRun:
            # the emulator ignores destinationTable: say it in SQL
            t = query.destinationTable
            query.query = f"CREATE OR REPLACE TABLE `{t.projectId}.{t.datasetId}.{t.tableId}` AS {query.query}"
            query.destinationTable = None
        return original_insert(request, *args, **kwargs)

    # apitools finds a method's config as an attribute of the method itself
    for service, name, wrapper in ((client.datasets, "List", list_with_label_filter),
                                   (client.jobs, "Insert", insert_job)):
        wrapper.method_config = getattr(service, name).method_config
        setattr(service, name, wrapper)
    return client


def _labels_in_filter(filter_str: str | None) -> dict[str, str]:
    """``labels.k:v labels.k2:v2`` -> {k: v, k2: v2} (the syntax Beam writes)."""
    return dict(re.findall(r"labels\.([^:\s]+):(\S+)", filter_str or ""))


def _has_labels(client, dataset, wanted: dict[str, str]) -> bool:
    from apache_beam.io.gcp.internal.clients import bigquery

    ref = dataset.datasetReference
    full = client.datasets.Get(bigquery.BigqueryDatasetsGetRequest(projectId=ref.projectId,
                                                                    datasetId=ref.datasetId))
    labels = {p.key: p.value for p in (full.labels.additionalProperties if full.labels else [])}
    return all(labels.get(k) == v for k, v in wanted.items())


def _cloud_client(endpoint: Endpoint):
    from google.api_core.client_options import ClientOptions
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import bigquery

    return bigquery.Client(project=endpoint.project, credentials=AnonymousCredentials(),
                           client_options=ClientOptions(api_endpoint=endpoint.rest))


def _read_client(endpoint: Endpoint):
    import grpc
    from google.cloud import bigquery_storage_v1
    from google.cloud.bigquery_storage_v1.services.big_query_read.transports import BigQueryReadGrpcTransport

    if endpoint.grpc is None:
        raise ValueError("DIRECT_READ against --bigquery_endpoint needs --bigquery_storage_endpoint HOST:PORT")
    channel = grpc.insecure_channel(endpoint.grpc)
    return bigquery_storage_v1.BigQueryReadClient(transport=BigQueryReadGrpcTransport(channel=channel))


def _install_from_environment() -> None:
    value = os.environ.get(ENV_VAR)
    if value and _CURRENT is None:
        install(Endpoint(**json.loads(value)))


# Worker processes import this module as a Beam plugin: redirect them as the launcher did.
_install_from_environment()
