"""Reading a configuration file safely: bounded in size, with no duplicate keys and no alias bombs.

yaml.safe_load alone takes the last of two equal keys without a word, expands aliases without
limit (a 4.7 KB "billion laughs" file hung apply), recurses once per nesting level, and lets
through text that PostgreSQL refuses (NUL) or that is not Unicode at all (lone surrogates).
Here the file is composed into nodes first, the node graph is checked (every problem with its
path in the file), and only then constructed into Python values.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from configuration.report import ConfigError
from core.parsers import text_problem

MAX_FILE_BYTES = 1_048_576  # a large tenant's file is tens of kilobytes
MAX_NODES = 100_000  # values in the file, counting every use of an alias
MAX_DEPTH = 64  # nesting of mappings and lists
MAX_TEXT = 100_000  # characters in one value; fields have tighter limits of their own
MERGE_KEY = "tag:yaml.org,2002:merge"


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2's booleans: only true and false (any case).

    PyYAML implements YAML 1.1, where yes, no, on, off, y and n are booleans too: the documented
    fallback `{model: azure-backup, on: [timeout]}` became the key True and was refused, and a
    `country: no` would have become False. Here those are text; a field that wants a boolean says
    so (true or false) when it gets one."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


class FileData(dict):
    """The file's mapping, knowing where it was read from (policies may name files beside it)."""

    source: str = ""


def load_file(path: str | Path) -> dict:
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError([("", f"cannot read {path}: {exc.strerror or exc}")]) from None
    if len(raw) > MAX_FILE_BYTES:
        raise ConfigError([("", f"the file is larger than {MAX_FILE_BYTES} bytes")])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError([("", f"the file is not UTF-8 text (byte {exc.start})")]) from None
    data = FileData(load_text(text))
    data.source = str(path)
    return data


def load_text(text: str) -> dict:
    try:
        loader = _Loader(text)  # the reader refuses unprintable characters at once
    except yaml.YAMLError as exc:
        raise ConfigError([_yaml_error(exc)]) from None
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:
            raise ConfigError([("", f"nested more than {MAX_DEPTH} levels deep")]) from None
        except yaml.YAMLError as exc:
            raise ConfigError([_yaml_error(exc)]) from None
        problems = check_nodes(node) if node is not None else []
        if problems:
            raise ConfigError(problems)
        try:
            data = loader.construct_document(node) if node is not None else None
        except yaml.YAMLError as exc:
            raise ConfigError([_yaml_error(exc)]) from None
        except ValueError as exc:  # e.g. a timestamp such as 2026-02-30
            raise ConfigError([("", f"invalid YAML value: {exc}")]) from None
    finally:
        loader.dispose()
    if not isinstance(data, dict):
        raise ConfigError([("", "the file must be a mapping with a tenant section")])
    return data


def _yaml_error(exc: yaml.YAMLError) -> tuple[str, str]:
    if isinstance(exc, yaml.reader.ReaderError):
        return "", f"invalid YAML: character #x{exc.character:04x} at position {exc.position} is not allowed"
    mark = getattr(exc, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    return where, f"invalid YAML: {getattr(exc, 'problem', None) or exc}"


def check_nodes(root: Node) -> list[tuple[str, str]]:
    """Duplicate keys, bad text, depth and size (with aliases expanded), each at its path."""
    problems: list[tuple[str, str]] = []
    stack: list[tuple[Node, str, int]] = [(root, "", 0)]
    seen = 0
    while stack:
        node, path, depth = stack.pop()
        seen += 1
        if seen > MAX_NODES:
            # Stop here: walking on is what a YAML bomb wants.
            return problems + [
                (
                    "",
                    f"the file has more than {MAX_NODES} values once its aliases are "
                    f"expanded (a YAML alias bomb?)",
                )
            ]
        if depth > MAX_DEPTH:
            problems.append((path, f"nested more than {MAX_DEPTH} levels deep"))
            continue
        if isinstance(node, ScalarNode):
            problem = _text_problem(node.value)
            if problem:
                problems.append((path, problem))
        elif isinstance(node, SequenceNode):
            stack.extend(
                (child, f"{path}[{i}]", depth + 1) for i, child in reversed(list(enumerate(node.value)))
            )
        elif isinstance(node, MappingNode):
            stack.extend(reversed(_mapping_children(node, path, depth, problems)))
    return problems


def _mapping_children(
    node: MappingNode, path: str, depth: int, problems: list
) -> list[tuple[Node, str, int]]:
    children: list[tuple[Node, str, int]] = []
    first_line: dict[str, int] = {}
    for key_node, value_node in node.value:
        if key_node.tag == MERGE_KEY:
            children.append((value_node, path, depth))  # "<<: *base" merges the mapping into this one
            continue
        if not isinstance(key_node, ScalarNode):
            problems.append((path, "keys must be plain values, not lists or mappings"))
            continue
        key = key_node.value
        where = f"{path}.{key}" if path else key
        problem = _text_problem(key)
        if problem:
            problems.append((path, f"a key {problem}"))
            continue
        if key in first_line:
            problems.append((where, f"duplicate key (first at line {first_line[key]}); give each key once"))
            continue
        first_line[key] = key_node.start_mark.line + 1
        children.append((value_node, where, depth + 1))
    return children


def _text_problem(text: str) -> str | None:
    if len(text) > MAX_TEXT:
        return f"longer than {MAX_TEXT} characters"
    return text_problem(text)
