"""Typed, checked final answers: a version's `output_schema`, its retries and its grounded fields.

    spec key          what it is
    output_schema     a JSON Schema (draft 2020-12) the final answer must validate against
    output_retries    how many more answers the model is asked for after one that does not
                      validate, each told the errors (default 2, at most 10)
    grounded_fields   top-level fields of the output whose values must appear in a result of one
                      of this run's tool calls that succeeded, so an id the model made up fails

    problems(spec)                     what is wrong with those keys, at their paths (apply, API)
    check(text, output, results)       the final answer's parsed value and what is wrong with it
    instructions(output)               what the model is told about the answer's shape
    feedback(errors, output)           the user turn that gives a refused answer's errors back

The engine asks for another answer while the refused ones number no more than `output_retries`
(runs/engine/decisions.output_turn) and then ends the run `failed` with reason `invalid_output`
and the errors, never `succeeded`. Pure functions: no database, no network.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

OUTPUT_RETRIES = 2
MAX_OUTPUT_RETRIES = 10
MAX_ERRORS = 10
_FENCE = re.compile(r"^```[a-zA-Z]*\s*\n?(.*?)\n?```$", re.S)


@dataclass(frozen=True)
class OutputSpec:
    """A version's output contract as the engine reads it (agents.spec.AgentSpec.output)."""

    schema: dict
    retries: int = OUTPUT_RETRIES
    grounded: tuple[str, ...] = ()

    @classmethod
    def of(cls, spec: dict) -> OutputSpec | None:
        if not spec.get("output_schema"):
            return None
        return cls(
            schema=spec["output_schema"],
            retries=spec.get("output_retries", OUTPUT_RETRIES),
            grounded=tuple(spec.get("grounded_fields") or ()),
        )


def problems(spec: dict) -> list[tuple[str, str]]:
    """(path, message) for each bad output key of a version's spec."""
    found: list[tuple[str, str]] = []
    schema = spec.get("output_schema")
    given = {key for key in ("output_retries", "grounded_fields") if key in spec}
    if schema is None:
        found += [(key, "only with output_schema") for key in sorted(given)]
        return found
    if not isinstance(schema, dict):
        return [("output_schema", "must be a JSON Schema object")]
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        found.append(
            (f"output_schema{'.' + where if where else ''}", f"not a valid JSON Schema: {exc.message}")
        )
    retries = spec.get("output_retries", OUTPUT_RETRIES)
    if not isinstance(retries, int) or isinstance(retries, bool) or not 0 <= retries <= MAX_OUTPUT_RETRIES:
        found.append(("output_retries", f"must be a whole number from 0 to {MAX_OUTPUT_RETRIES}"))
    grounded = spec.get("grounded_fields", [])
    properties: dict = schema["properties"] if isinstance(schema.get("properties"), dict) else {}
    if not isinstance(grounded, list) or not all(isinstance(name, str) for name in grounded):
        found.append(("grounded_fields", "must be a list of field names"))
    else:
        for i, name in enumerate(grounded):
            if name not in properties:
                found.append((f"grounded_fields[{i}]", f"output_schema has no property {name!r}"))
    return found


def parse(text: str) -> tuple[Any, str]:
    """The answer's JSON value and "", or None and why it is not JSON. A fenced block (```json)
    or prose around one object is read as the object: small models add both."""
    stripped = text.strip()
    fenced = _FENCE.match(stripped)
    candidates = [fenced.group(1).strip()] if fenced else [stripped]
    start, end = stripped.find("{"), stripped.rfind("}")
    if 0 <= start < end:
        candidates.append(stripped[start : end + 1])
    for candidate in candidates:
        try:
            return json.loads(candidate), ""
        except ValueError:
            continue
    return None, "the answer is not JSON: answer with one JSON object and nothing else"


def check(text: str, output: OutputSpec, results: list[str]) -> tuple[Any, list[str]]:
    """The parsed answer and its problems (empty: accepted). `results`: the texts of this run's
    tool calls that succeeded, for the grounded fields."""
    value, not_json = parse(text)
    if not_json:
        return None, [not_json]
    errors = [
        f"{'/'.join(str(p) for p in error.absolute_path) or '(the answer)'}: {error.message}"
        for error in sorted(
            Draft202012Validator(output.schema).iter_errors(value), key=lambda e: list(e.path)
        )
    ][:MAX_ERRORS]
    if errors or not isinstance(value, dict):
        return value, errors
    for name in output.grounded:
        if name not in value or value[name] is None:
            continue  # required-ness is the schema's
        wanted = value[name] if isinstance(value[name], str) else json.dumps(value[name])
        if not any(wanted in result for result in results):
            errors.append(
                f"{name}: {wanted!r} does not appear in any result of this run's tool calls; "
                "take it from a tool result, do not make it up"
            )
    return value, errors


def instructions(output: OutputSpec) -> str:
    """Appended to the version's instructions: the answer's shape, the same bytes on every call."""
    text = (
        "\n\nYour final answer (when you call no more tools) must be one JSON object, and nothing else, "
        "that matches this JSON Schema:\n" + json.dumps(output.schema, sort_keys=True)
    )
    if output.grounded:
        text += (
            "\nThe values of these fields must be copied from the results of your tool calls: "
            + ", ".join(output.grounded)
        )
    return text


def feedback(errors: list[str]) -> str:
    """The user turn after a refused answer."""
    return (
        "[platform: your answer was not accepted]\n"
        + "\n".join(f"- {error}" for error in errors)
        + "\nAnswer again with one JSON object that matches the schema, or call a tool first if you need data."
    )
