"""A small, safe expression language for approval rules on tool-call arguments.

Example: ``amount > 5000 or currency != "INR"``.

The text is tokenised and parsed by hand into frozen dataclasses and then
interpreted; nothing is ever handed to ``eval``/``compile``, so a policy can
only read argument values, never run code.

Evaluation is fail safe. A comparison whose field is missing or whose operands
have incompatible types is *unknown*, and unknowns combine with Kleene logic
(``unknown or true`` is true, ``unknown and false`` is false, ``not unknown``
is unknown). A policy whose result is unknown requires approval, so odd
arguments can never cause an approval to be skipped, not even under ``not``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Union

MAX_LENGTH = 2000
MAX_DEPTH = 32

__all__ = [
    "MAX_DEPTH",
    "MAX_LENGTH",
    "Decision",
    "Policy",
    "PolicyError",
    "canonical",
    "parse_policy",
    "stricter",
]


class PolicyError(ValueError):
    """A policy text that cannot be parsed; ``position`` is a 0-based offset."""

    def __init__(self, detail: str, position: int) -> None:
        super().__init__(f"{detail} at position {position}")
        self.detail = detail
        self.position = position


# --------------------------------------------------------------------------
# AST

Scalar = Union[Decimal, str, bool, None]
LiteralValue = Union[Scalar, tuple[Scalar, ...]]


@dataclass(frozen=True)
class Field:
    # str segments are mapping keys, int segments are list indexes.
    path: tuple[str | int, ...]


@dataclass(frozen=True)
class Literal:
    value: LiteralValue


Operand = Union[Field, Literal]


@dataclass(frozen=True)
class Compare:
    op: str  # one of == != < <= > >= in "not in"
    left: Operand
    right: Operand


@dataclass(frozen=True)
class Not:
    operand: Expr


@dataclass(frozen=True)
class And:
    operands: tuple[Expr, ...]


@dataclass(frozen=True)
class Or:
    operands: tuple[Expr, ...]


@dataclass(frozen=True)
class Always:
    pass


@dataclass(frozen=True)
class Never:
    pass


Expr = Union[Compare, Not, And, Or]
Node = Union[Expr, Always, Never]


@dataclass(frozen=True)
class Decision:
    required: bool
    reason: str


@dataclass(frozen=True)
class Policy:
    root: Node

    @property
    def text(self) -> str:
        return _render(self.root)

    def __str__(self) -> str:
        return self.text

    def evaluate(self, arguments: Mapping[str, object]) -> Decision:
        if isinstance(self.root, Always):
            return Decision(True, "policy: always")
        if isinstance(self.root, Never):
            return Decision(False, "policy: never")
        outcome = _evaluate(self.root, arguments, negated=False)
        # None (unknown) requires approval: that is the fail-safe rule.
        return Decision(outcome.value is not False, "; ".join(outcome.reasons))


# --------------------------------------------------------------------------
# Tokeniser

KEYWORDS = frozenset({"and", "or", "not", "in", "true", "false", "null", "always", "never"})
COMPARISON_OPS = ("==", "!=", "<=", ">=", "<", ">")
PUNCTUATION = "()[],."
ESCAPES = {"\\": "\\", '"': '"', "'": "'", "n": "\n", "t": "\t", "r": "\r"}


@dataclass(frozen=True)
class Token:
    kind: str  # number, string, name, keyword, op, punct, end
    text: str  # source text; for strings, the decoded value
    position: int


def _is_name_start(char: str) -> bool:
    return char == "_" or ("a" <= char <= "z") or ("A" <= char <= "Z")


def _is_name_char(char: str) -> bool:
    return _is_name_start(char) or _is_digit(char)


def _is_digit(char: str) -> bool:
    return "0" <= char <= "9"


def _tokenize(text: str) -> list[Token]:
    tokens: list[Token] = []
    i = 0
    while i < len(text):
        char = text[i]
        if char in " \t\r\n":
            i += 1
        elif _is_digit(char) or (char == "-" and _is_digit(text[i + 1 : i + 2])):
            token, i = _read_number(text, i)
            tokens.append(token)
        elif char in "\"'":
            token, i = _read_string(text, i)
            tokens.append(token)
        elif _is_name_start(char):
            start = i
            while i < len(text) and _is_name_char(text[i]):
                i += 1
            word = text[start:i]
            tokens.append(Token("keyword" if word in KEYWORDS else "name", word, start))
        elif text.startswith(COMPARISON_OPS, i):
            op = next(op for op in COMPARISON_OPS if text.startswith(op, i))
            tokens.append(Token("op", op, i))
            i += len(op)
        elif char in PUNCTUATION:
            tokens.append(Token("punct", char, i))
            i += 1
        elif char == "=":
            raise PolicyError("unexpected character '=' (use '==' to compare)", i)
        else:
            raise PolicyError(f"unexpected character {char!r}", i)
    tokens.append(Token("end", "", len(text)))
    return tokens


def _read_number(text: str, start: int) -> tuple[Token, int]:
    i = start + 1
    while i < len(text) and _is_digit(text[i]):
        i += 1
    if text[i : i + 1] == "." and _is_digit(text[i + 1 : i + 2]):
        i += 2
        while i < len(text) and _is_digit(text[i]):
            i += 1
    # "5000abc" or "1e3" is a typo, not a number followed by a field.
    if i < len(text) and _is_name_char(text[i]):
        raise PolicyError(f"invalid number {text[start : i + 1]!r}", start)
    return Token("number", text[start:i], start), i


def _read_string(text: str, start: int) -> tuple[Token, int]:
    quote = text[start]
    chars: list[str] = []
    i = start + 1
    while i < len(text):
        char = text[i]
        if char == quote:
            return Token("string", "".join(chars), start), i + 1
        if char == "\\":
            escaped = text[i + 1 : i + 2]
            if escaped not in ESCAPES:
                raise PolicyError(f"invalid escape '\\{escaped}' in string", i)
            chars.append(ESCAPES[escaped])
            i += 2
        else:
            chars.append(char)
            i += 1
    raise PolicyError("unterminated string", start)


# --------------------------------------------------------------------------
# Parser


class _Parser:
    def __init__(self, text: str) -> None:
        self.tokens = _tokenize(text)
        self.index = 0
        self.depth = 0

    @property
    def current(self) -> Token:
        return self.tokens[self.index]

    def advance(self) -> Token:
        token = self.current
        self.index += 1
        return token

    def at(self, kind: str, text: str) -> bool:
        return self.current.kind == kind and self.current.text == text

    def fail(self, token: Token | None = None) -> PolicyError:
        token = token or self.current
        if token.kind == "end":
            return PolicyError("unexpected end of policy", token.position)
        shown = repr(token.text) if token.kind == "string" else f"'{token.text}'"
        return PolicyError(f"unexpected token {_clip(shown)}", token.position)

    def expect(self, kind: str, text: str) -> Token:
        if not self.at(kind, text):
            if self.current.kind == "end":
                raise PolicyError(f"expected '{text}'", self.current.position)
            raise self.fail()
        return self.advance()

    def enter(self, position: int) -> None:
        # Bounded so that hostile input cannot exhaust the Python stack.
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise PolicyError(f"nesting deeper than {MAX_DEPTH}", position)

    def policy(self) -> Node:
        if self.current.kind == "end":
            raise PolicyError("empty policy", self.current.position)
        if self.at("keyword", "always") or self.at("keyword", "never"):
            word = self.advance().text
            if self.current.kind != "end":
                raise self.fail()
            return Always() if word == "always" else Never()
        node = self.or_expr()
        if self.current.kind != "end":
            raise self.fail()
        return node

    def or_expr(self) -> Expr:
        operands = [self.and_expr()]
        while self.at("keyword", "or"):
            self.advance()
            operands.append(self.and_expr())
        return _combine(Or, operands)

    def and_expr(self) -> Expr:
        operands = [self.not_expr()]
        while self.at("keyword", "and"):
            self.advance()
            operands.append(self.not_expr())
        return _combine(And, operands)

    def not_expr(self) -> Expr:
        if self.at("keyword", "not"):
            self.enter(self.advance().position)
            node = Not(self.not_expr())
            self.depth -= 1
            return node
        if self.at("punct", "("):
            self.enter(self.advance().position)
            node = self.or_expr()
            self.expect("punct", ")")
            self.depth -= 1
            return node
        return self.comparison()

    def comparison(self) -> Compare:
        left_token = self.current
        left = self.operand()
        if self.current.kind == "op" or self.at("keyword", "in"):
            op = self.advance().text
        elif self.at("keyword", "not"):
            self.advance()
            self.expect("keyword", "in")
            op = "not in"
        else:
            raise self.fail()
        right_token = self.current
        right = self.operand()
        _check_operands(op, left, left_token, right, right_token)
        return Compare(op, left, right)

    def operand(self) -> Operand:
        token = self.current
        if token.kind == "name":
            return self.field()
        if self.at("punct", "["):
            return self.list_literal()
        return Literal(self.scalar())

    def field(self) -> Field:
        path: list[str | int] = [self.advance().text]
        while True:
            if self.at("punct", "."):
                self.advance()
                if self.current.kind not in ("name", "keyword"):
                    raise self.fail()
                path.append(self.advance().text)
            elif self.at("punct", "["):
                self.advance()
                token = self.current
                if token.kind != "number" or not token.text.isdigit():
                    raise PolicyError("list index must be a non-negative integer", token.position)
                path.append(int(self.advance().text))
                self.expect("punct", "]")
            else:
                return Field(tuple(path))

    def list_literal(self) -> Literal:
        self.advance()
        items: list[Scalar] = []
        while not self.at("punct", "]"):
            items.append(self.scalar())
            if not self.at("punct", "]"):
                self.expect("punct", ",")
        self.advance()
        return Literal(tuple(items))

    def scalar(self) -> Scalar:
        token = self.current
        if token.kind == "number":
            self.advance()
            return Decimal(token.text)
        if token.kind == "string":
            self.advance()
            return token.text
        if token.kind == "keyword" and token.text in ("true", "false", "null"):
            self.advance()
            return {"true": True, "false": False, "null": None}[token.text]
        raise self.fail()


def _check_operands(op: str, left: Operand, left_token: Token, right: Operand, right_token: Token) -> None:
    """Reject comparisons that could never be meaningful, so typos surface at save time."""
    if isinstance(left, Literal) and isinstance(left.value, tuple):
        if op not in ("==", "!="):
            raise PolicyError(f"a list cannot be used with '{op}'", left_token.position)
    if isinstance(right, Literal) and isinstance(right.value, tuple):
        if op in ("<", "<=", ">", ">="):
            raise PolicyError(f"a list cannot be used with '{op}'", right_token.position)
    elif isinstance(right, Literal) and op in ("in", "not in"):
        raise PolicyError(f"'{op}' needs a list on its right", right_token.position)


def _combine(kind: type[And] | type[Or], operands: list[Expr]) -> Expr:
    """Flatten nested and/or and drop duplicates so equivalent texts share one canonical form."""
    if len(operands) == 1:
        return operands[0]
    flat: list[Expr] = []
    seen: set[str] = set()
    for operand in operands:
        for item in operand.operands if isinstance(operand, kind) else (operand,):
            # Keyed by rendered text: dataclass equality would treat true == 1.
            key = _render(item)
            if key not in seen:
                seen.add(key)
                flat.append(item)
    return flat[0] if len(flat) == 1 else kind(tuple(flat))


def parse_policy(text: str) -> Policy:
    if not isinstance(text, str):
        raise PolicyError("policy must be text", 0)
    if len(text) > MAX_LENGTH:
        raise PolicyError(f"policy longer than {MAX_LENGTH} characters", MAX_LENGTH)
    policy = Policy(_Parser(text).policy())
    # Stored policies are canonical text, which must itself parse again.
    if len(policy.text) > MAX_LENGTH:
        raise PolicyError(f"policy longer than {MAX_LENGTH} characters once normalised", 0)
    return policy


# --------------------------------------------------------------------------
# Rendering (canonical text)

_PRECEDENCE = {Or: 1, And: 2, Not: 3, Compare: 4}


def _render(node: Node) -> str:
    if isinstance(node, Always):
        return "always"
    if isinstance(node, Never):
        return "never"
    if isinstance(node, Compare):
        return f"{_render_operand(node.left)} {node.op} {_render_operand(node.right)}"
    if isinstance(node, Not):
        return f"not {_render_child(node.operand, Not)}"
    joiner = " or " if isinstance(node, Or) else " and "
    return joiner.join(_render_child(child, type(node)) for child in node.operands)


def _render_child(child: Expr, parent: type) -> str:
    # Parentheses only where precedence demands, so rendering never nests
    # deeper than the text it was parsed from.
    text = _render(child)
    return f"({text})" if _PRECEDENCE[type(child)] < _PRECEDENCE[parent] else text


def _render_operand(operand: Operand) -> str:
    if isinstance(operand, Field):
        return _render_path(operand.path)
    return _render_literal(operand.value)


def _render_path(path: tuple[str | int, ...]) -> str:
    parts = [str(path[0])]
    for segment in path[1:]:
        parts.append(f"[{segment}]" if isinstance(segment, int) else f".{segment}")
    return "".join(parts)


def _render_literal(value: LiteralValue) -> str:
    if isinstance(value, tuple):
        return "[" + ", ".join(_render_literal(item) for item in value) + "]"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Decimal):
        return str(value)
    escaped = value.replace("\\", "\\\\").replace("'", "\\'")
    escaped = escaped.replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")
    return f"'{escaped}'"


def canonical(policy: str | Policy) -> str:
    """Normalised text for digests: equal for texts differing only in layout."""
    if isinstance(policy, str):
        policy = parse_policy(policy)
    return policy.text


def stricter(base: str, override: str | None) -> str:
    """Effective policy when an agent version overrides a tool's policy.

    The result requires approval whenever either policy does, so an override
    can only tighten the base, never loosen it.
    """
    base_root = parse_policy(base).root
    if override is None or not override.strip():
        return _render(base_root)
    override_root = parse_policy(override).root
    if isinstance(base_root, Always) or isinstance(override_root, Always):
        return "always"
    if isinstance(override_root, Never):
        return _render(base_root)
    if isinstance(base_root, Never):
        return _render(override_root)
    text = _render(_combine(Or, [base_root, override_root]))
    if len(text) > MAX_LENGTH:
        # Refuse rather than truncate: a shortened policy could be looser.
        raise PolicyError(f"combined policy longer than {MAX_LENGTH} characters", 0)
    return text


# --------------------------------------------------------------------------
# Evaluation


@dataclass(frozen=True)
class _Outcome:
    value: bool | None  # None means unknown: missing field or type mismatch
    reasons: tuple[str, ...]


class _Mismatch(Exception):
    pass


class _Missing(Exception):
    def __init__(self, field: Field) -> None:
        self.field = field


_NEGATED = {
    "==": "!=",
    "!=": "==",
    "<": ">=",
    ">=": "<",
    ">": "<=",
    "<=": ">",
    "in": "not in",
    "not in": "in",
}


def _evaluate(node: Expr, arguments: object, negated: bool) -> _Outcome:
    # Negation is pushed down to the comparisons (De Morgan) so that the
    # and/or groups can pick the operands that actually decided the result.
    if isinstance(node, Compare):
        return _evaluate_compare(node, arguments, negated)
    if isinstance(node, Not):
        return _evaluate(node.operand, arguments, not negated)
    outcomes = [_evaluate(child, arguments, negated) for child in node.operands]
    is_or = isinstance(node, Or) != negated
    decisive = is_or  # the value that settles the whole group on its own
    for wanted in (decisive, None):
        matching = [o for o in outcomes if o.value is wanted]
        if matching:
            return _Outcome(wanted, tuple(r for o in matching for r in o.reasons))
    return _Outcome(not decisive, tuple(r for o in outcomes for r in o.reasons))


def _evaluate_compare(node: Compare, arguments: object, negated: bool) -> _Outcome:
    try:
        left = _resolve(node.left, arguments)
        right = _resolve(node.right, arguments)
    except _Missing as missing:
        return _Outcome(None, (f"{_render_path(missing.field.path)} is missing",))
    try:
        result = _apply(node.op, left, right)
    except _Mismatch:
        subject = next(
            (_render_operand(o) for o in (node.left, node.right) if isinstance(o, Field)), _render(node)
        )
        return _Outcome(None, (f"{subject}: cannot compare {_show(left)} with {_show(right)}",))
    # The reason states what actually holds, whichever way the rule went.
    op = node.op if result else _NEGATED[node.op]
    text = f"{_render_operand(node.left)} {op} {_render_operand(node.right)}"
    values = []
    for operand, value in ((node.left, left), (node.right, right)):
        if isinstance(operand, Field):
            entry = f"{_render_operand(operand)} = {_show(value)}"
            if entry not in values:
                values.append(entry)
    if values:
        text += f" ({', '.join(values)})"
    return _Outcome(result != negated, (text,))


def _resolve(operand: Operand, arguments: object) -> object:
    if isinstance(operand, Literal):
        return operand.value
    value = arguments
    # Only item lookups on plain data, never attribute access.
    for segment in operand.path:
        if (
            isinstance(segment, str)
            and isinstance(value, Mapping)
            and segment in value
            or isinstance(segment, int)
            and isinstance(value, (list, tuple))
            and segment < len(value)
        ):
            value = value[segment]
        else:
            raise _Missing(operand)
    return value


def _kind(value: object) -> tuple[str, object]:
    """Classify a value; numbers become Decimal so 0.1 + 0.2 style surprises cannot happen."""
    if value is None:
        return "null", None
    if isinstance(value, bool):  # before int: bool is not a number here
        return "bool", value
    if isinstance(value, int):
        return "number", Decimal(value)
    if isinstance(value, float):
        return (
            ("number", Decimal(repr(value)))
            if value == value and abs(value) != float("inf")
            else ("other", value)
        )
    if isinstance(value, Decimal):
        return ("number", value) if value.is_finite() else ("other", value)
    if isinstance(value, str):
        return "string", value
    if isinstance(value, (list, tuple)):
        return "list", value
    return "other", value


def _equal(left: object, right: object) -> bool:
    left_kind, left_value = _kind(left)
    right_kind, right_value = _kind(right)
    if left_kind == "null" or right_kind == "null":
        return left_kind == right_kind
    if left_kind != right_kind or left_kind == "other":
        raise _Mismatch()
    if left_kind == "list":
        assert isinstance(left_value, (list, tuple)) and isinstance(right_value, (list, tuple))
        return len(left_value) == len(right_value) and all(map(_equal, left_value, right_value))
    return left_value == right_value


def _contains(item: object, container: object) -> bool:
    if _kind(container)[0] != "list":
        raise _Mismatch()
    assert isinstance(container, (list, tuple))
    comparable = False
    for element in container:
        try:
            if _equal(item, element):
                return True
            comparable = True
        except _Mismatch:
            continue
    # "amount in ['INR']" with a number amount is a type error, not a "no".
    if container and not comparable:
        raise _Mismatch()
    return False


def _apply(op: str, left: object, right: object) -> bool:
    if op == "==":
        return _equal(left, right)
    if op == "!=":
        return not _equal(left, right)
    if op == "in":
        return _contains(left, right)
    if op == "not in":
        return not _contains(left, right)
    left_kind, left_value = _kind(left)
    right_kind, right_value = _kind(right)
    if left_kind != right_kind or left_kind not in ("number", "string"):
        raise _Mismatch()
    if op == "<":
        return left_value < right_value  # type: ignore[operator]
    if op == "<=":
        return left_value <= right_value  # type: ignore[operator]
    if op == ">":
        return left_value > right_value  # type: ignore[operator]
    return left_value >= right_value  # type: ignore[operator]


def _show(value: object) -> str:
    """Argument values as shown in reasons; clipped because reasons end up in logs and UIs."""
    kind, normalised = _kind(value)
    if kind == "number":
        return str(normalised)
    if kind == "bool":
        return "true" if value else "false"
    if kind == "null":
        return "null"
    if kind == "string":
        return _clip(repr(value))
    if kind == "list":
        assert isinstance(value, (list, tuple))
        return _clip(
            "[" + ", ".join(_show(item) for item in value[:10]) + (", ..." if len(value) > 10 else "") + "]"
        )
    if isinstance(value, Mapping):
        return "an object"
    return f"a {type(value).__name__}"


def _clip(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
