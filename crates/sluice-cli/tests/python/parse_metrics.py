"""Parses a Prometheus text exposition from stdin with prometheus_client's parser (the reference
implementation's format rules) and prints every sample as JSON: {"name{label=value,...}": value}.
A malformed exposition raises, so the caller sees a non-zero exit and the parser's message."""

import json
import sys

from prometheus_client.parser import text_string_to_metric_families

samples = {}
for family in text_string_to_metric_families(sys.stdin.read()):
    for sample in family.samples:
        labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
        samples[f"{sample.name}{{{labels}}}"] = sample.value
json.dump(samples, sys.stdout, sort_keys=True)
