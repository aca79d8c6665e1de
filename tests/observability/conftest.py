"""Helpers to read /metrics and the engine's log lines as an operator's tools would."""

from __future__ import annotations

import io
import json
import logging

import pytest
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families

from observability.logs import JsonFormatter, RunContextFilter


def scrape(client: Client | None = None, **headers) -> dict:
    response = (client or Client()).get("/metrics", **headers)
    assert response.status_code == 200, response.content
    return parse(response.content.decode())


def parse(text: str) -> dict:
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(samples: dict, name: str, **labels) -> float:
    """A sample's value; 0 for a labelled counter that has not been touched yet."""
    return samples.get((name, frozenset(labels.items())), 0.0)


@pytest.fixture
def json_lines():
    """The root logger at INFO through the handler the settings configure (filter + JSON formatter)."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(RunContextFilter())
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    yield lambda: [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]
    root.removeHandler(handler)
    root.setLevel(old_level)
