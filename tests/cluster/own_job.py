"""A Beam job of a user's own that applies `ClassifyText` (run by tests/cluster/test_flink.py
on Flink and on the DirectRunner): CSV lines in, JSON lines with each ticket's label and score
out, written by Beam's own text sink; its last stdout line is the step's metrics as the job's
result reports them. Given --temp_location, it stages the embedded model there for workers
that lack it (`beam_prefix.stage_embedded_model`)."""

import argparse
import csv
import json
import sys

import apache_beam as beam
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.options.pipeline_options import GoogleCloudOptions, PipelineOptions

from beam_prefix import stage_embedded_model
from beam_prefix.transforms import ClassifyText


def parse(line: str) -> dict:
    ticket_id, text, label = next(csv.reader([line]))
    return {"ticket_id": ticket_id, "text": text, "label": label}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    args, beam_args = parser.parse_known_args(argv)
    options = PipelineOptions(beam_args)
    temp = options.view_as(GoogleCloudOptions).temp_location
    # a cluster's workers built from the package lack the embedded model: stage it where they read
    model = stage_embedded_model(temp) if temp else "embedded"
    p = beam.Pipeline(options=options)
    labelled = (p | beam.io.ReadFromText(args.input, skip_header_lines=1) | beam.Map(parse)
                | ClassifyText("support_tickets_head", model=model, id_column="ticket_id", keep_columns=["ticket_id"]))
    _ = (labelled.labeled | beam.Map(lambda r: json.dumps({"ticket_id": r["ticket_id"], "label": r["label"],
                                                            "score": r["score"]}))
         | beam.io.WriteToText(args.output))
    result = p.run()
    result.wait_until_finish()
    counters = result.metrics().query(MetricsFilter())["counters"]
    print(json.dumps({c.key.metric.name: c.committed if c.committed is not None else c.attempted
                      for c in counters}))


if __name__ == "__main__":
    main(sys.argv[1:])
