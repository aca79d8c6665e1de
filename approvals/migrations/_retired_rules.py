"""The retired approval expressions (``amount > 5000 or currency != "INR"``), read one way: into
Cedar. Frozen with the migration that converted every stored rule (0006_approval_rules_in_cedar);
nothing evaluates them and nothing stores them any more (approvals/tool_rules.py holds the Cedar).

Two readers: that migration, once, and approvals/tool_rules.py, which answers a rule still
written this way (in a file, in the admin, in a version's overrides) with the Cedar to write
instead. The text is tokenised and parsed by hand (nothing reaches eval) and `to_cedar` gives one
Cedar permit annotated `@approval`; a form with no exact Cedar equivalent raises Unconvertible,
carrying the nearest stricter Cedar policy.

The old language was fail safe: a comparison whose field is missing or whose operands have
incompatible types is *unknown*, unknowns combine with Kleene logic, and an unknown result
requires approval. The translation keeps that: approval is required unless the expression is
definitely false, where "definitely" means every field it reads is present (`has` guards). A
value of the wrong type makes Cedar raise an error, and an @approval policy that errors requires
approval (approvals/cedar.py), so a mismatch never skips an approval; it can require one where
the old language had found another operand of an `and` false (arguments are checked against
the tool's JSON schema before any policy runs, so for declared fields this cannot happen).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import ROUND_FLOOR, Decimal
from typing import Union

MAX_LENGTH = 2000
MAX_DEPTH = 32

__all__ = [
    "MAX_DEPTH",
    "MAX_LENGTH",
    "Policy",
    "PolicyError",
    "Unconvertible",
    "parse_policy",
    "to_cedar",
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
class Policy:
    root: Node

    @property
    def text(self) -> str:
        return _render(self.root)

    def __str__(self) -> str:
        return self.text


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
            negated = Not(self.not_expr())
            self.depth -= 1
            return negated
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


# --------------------------------------------------------------------------
# Conversion to Cedar

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_CEDAR_RESERVED = frozenset(
    {"true", "false", "if", "then", "else", "in", "like", "has", "is", "__cedar", "permit", "forbid"}
)
_LONG_MAX = 2**63 - 1


class Unconvertible(PolicyError):
    """A rule with a part Cedar cannot express exactly. `nearest` is the Cedar policy that asks
    for approval wherever the rule did and also wherever those parts would have decided: the
    parts are taken as undecided, which under the old rule's Kleene logic can only turn a "no
    approval" into "approval", never the reverse. Printed for the tenant to adopt or rewrite."""

    def __init__(self, detail: str, nearest: str, parts: list[str]) -> None:
        super().__init__(detail, 0)
        self.nearest = nearest
        self.parts = parts

    @property
    def advice(self) -> str:
        return (
            f"{self.detail}. The nearest stricter Cedar policy (it also asks for approval where "
            f"{'; '.join(self.parts)} would have decided) is:\n{self.nearest}"
        )


def to_cedar(text: str, *, tool: str, policy_id: str) -> str:
    """The Cedar policy that requires approval exactly when `text` does; "" for `never`.

    Raises PolicyError for text that does not parse, and Unconvertible for a form Cedar cannot
    express exactly, with what to write instead and the nearest stricter policy.
    """
    root = parse_policy(text).root
    if isinstance(root, Never):
        return ""
    try:
        return _policy(root, tool=tool, policy_id=policy_id, refused=None)
    except PolicyError as exc:
        parts: list[str] = []
        nearest = _policy(root, tool=tool, policy_id=policy_id, refused=parts)
        raise Unconvertible(exc.detail, nearest, sorted(set(parts))) from None


def _policy(root: Expr | Always, *, tool: str, policy_id: str, refused: list[str] | None) -> str:
    condition = "true" if isinstance(root, Always) else f"!({_cedar(root, want=False, refused=refused)})"
    return (
        f"@id({_cedar_string(policy_id)})\n@approval({_cedar_string('policy: ' + _render(root))})\n"
        f"permit (principal, action == Action::{_cedar_string(tool)}, resource)\n"
        f"when {{ {condition} }};"
    )


def _cedar(node: Expr, *, want: bool, refused: list[str] | None = None) -> str:
    """A Cedar expression true exactly when `node` is definitely `want` (all its fields present).

    `refused`: None raises PolicyError on a comparison Cedar cannot express; a list takes such a
    comparison as never definite ("false") and notes it there (Unconvertible.nearest)."""
    if isinstance(node, Not):
        return _cedar(node.operand, want=not want, refused=refused)
    if isinstance(node, (And, Or)):
        # "definitely true" of an and, or "definitely false" of an or, needs every operand.
        joiner = " && " if isinstance(node, And) == want else " || "
        return "(" + joiner.join(_cedar(child, want=want, refused=refused) for child in node.operands) + ")"
    try:
        return _cedar_leaf(node, want=want)
    except PolicyError:
        if refused is None:
            raise
        refused.append(f"`{_render(node)}`")
        return "false"


def _cedar_leaf(node: Compare, *, want: bool) -> str:
    present = _null_compare(node)
    if present is not None:
        # Cedar cannot tell a null argument from a missing one (both are left out), and a missing
        # one left the old rule undecided: never definitely null, definitely not when present.
        return f"({present})" if not want else "false"
    guards, comparison = _cedar_compare(node)
    if not want:
        comparison = f"!({comparison})"
    return "(" + " && ".join([*guards, comparison]) + ")"


_MIRROR = {"<": ">", "<=": ">=", ">": "<", ">=": "<=", "==": "==", "!=": "!="}


def _fraction(operand: Operand) -> Decimal | None:
    value = operand.value if isinstance(operand, Literal) else None
    if isinstance(value, Decimal) and not isinstance(value, bool) and value != value.to_integral_value():
        return value
    return None


def _whole_number_compare(node: Compare) -> tuple[list[str], str] | None:
    """A field compared with a fractional literal (`amount > 99.99`), for whole-number arguments:
    the literal rounded the way the comparison keeps its answer (> 99, >= 100, < 100, <= 99;
    == never). A fractional argument reaches Cedar as a decimal, which errors against a whole
    number: the @approval policy then asks for approval, stricter than the old rule, never looser."""
    left, right, op = node.left, node.right, node.op
    if _fraction(left) is not None and isinstance(right, Field):
        left, right, op = right, left, _MIRROR.get(op, op)
    limit = _fraction(right)
    if limit is None or not isinstance(left, Field) or op not in _MIRROR:
        return None
    guards: list[str] = []
    field, _ = _cedar_operand(left, guards)
    down = int(limit.to_integral_value(rounding=ROUND_FLOOR))
    if abs(down) + 1 > _LONG_MAX:
        raise PolicyError(f"{limit}: larger than Cedar's 64-bit numbers", 0)
    number = _type_check(field, "number")
    expression = {
        ">": f"{field} > {down}",
        ">=": f"{field} > {down}",
        "<": f"{field} <= {down}",
        "<=": f"{field} <= {down}",
        "==": f"{number} && false",
        "!=": f"{number} && true",
    }[op]
    return guards, expression


def _null_compare(node: Compare) -> str | None:
    """For `field == null`: the Cedar test that the argument is there (not null, not missing);
    None for any other comparison (`!= null` has no equivalent: see _cedar_literal)."""
    left, right = node.left, node.right
    if isinstance(left, Literal) and isinstance(right, Field):
        left, right = right, left
    if (
        node.op != "=="
        or not isinstance(left, Field)
        or not isinstance(right, Literal)
        or right.value is not None
    ):
        return None
    if any(isinstance(segment, int) for segment in left.path):
        return None
    parent, name = "context.arguments", left.path[-1]
    checks = []
    for segment in left.path[:-1]:
        checks.append(f"{parent} has {_cedar_attr(segment)}")  # type: ignore[arg-type]
        parent = _cedar_get(parent, segment)  # type: ignore[arg-type]
    return " && ".join([*checks, f"{parent} has {_cedar_attr(name)}"])  # type: ignore[arg-type]


def _cedar_compare(node: Compare) -> tuple[list[str], str]:
    converted = _whole_number_compare(node)
    if converted is not None:
        return converted
    guards: list[str] = []
    left, left_kind = _cedar_operand(node.left, guards)
    right, right_kind = _cedar_operand(node.right, guards)
    op = node.op
    if op in ("in", "not in"):
        if right_kind == "list":
            kinds = {_kind_of(item) for item in node.right.value}  # type: ignore[union-attr]
            if len(kinds) > 1:
                raise PolicyError("a list of mixed types has no Cedar equivalent: use one type per list", 0)
            check = _type_check(left, kinds.pop()) if kinds else None
            expression = f"{right}.contains({left})"
            expression = f"{check} && {expression}" if check else expression
        elif right_kind == "field":
            expression = f"{right}.contains({left})"
        else:
            raise PolicyError(f"'{op}' needs a list on its right", 0)
        return guards, expression if op == "in" else f"!({expression})"
    if "list" in (left_kind, right_kind):
        raise PolicyError(
            "comparing with a list literal has no Cedar equivalent (Cedar sets ignore order and "
            "repeats): compare the elements, or use `in`",
            0,
        )
    if op in ("==", "!="):
        if left_kind == "field" and right_kind == "field":
            raise PolicyError(
                "comparing two fields for equality has no exact Cedar equivalent (Cedar answers "
                "false where the old rule asked for approval): compare each with a literal",
                0,
            )
        field, kind = (left, right_kind) if left_kind == "field" else (right, left_kind)
        check = _type_check(field, kind) if left_kind != right_kind else None
        expression = f"{left} == {right}"
        if check:
            expression = f"{check} && {expression}"
        return guards, expression if op == "==" else f"!({expression})"
    for kind in (left_kind, right_kind):
        if kind not in ("field", "number"):
            raise PolicyError(
                f"'{op}' on {kind} values has no Cedar equivalent: Cedar orders whole numbers only", 0
            )
    return guards, f"{left} {op} {right}"


def _kind_of(value: Scalar) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, Decimal):
        return "number"
    return "string"


def _type_check(expression: str, kind: str) -> str:
    """An expression that is true for a value of `kind` and an error for any other type: an
    error in an @approval policy requires approval, as a type mismatch did in the old rule."""
    return {
        "string": f'({expression} like "*")',
        "number": f"({expression} < 0 || true)",
        "bool": f"({expression} || true)",
    }[kind]


def _cedar_operand(operand: Operand, guards: list[str]) -> tuple[str, str]:
    if isinstance(operand, Field):
        expression = "context.arguments"
        for segment in operand.path:
            if isinstance(segment, int):
                raise PolicyError(
                    f"{_render_path(operand.path)}: Cedar has no list indexes; give the tool a "
                    "named argument for that value",
                    0,
                )
            guard = f"{expression} has {_cedar_attr(segment)}"
            if guard not in guards:
                guards.append(guard)
            expression = _cedar_get(expression, segment)
        return expression, "field"
    value = operand.value
    if isinstance(value, tuple):
        return "[" + ", ".join(_cedar_literal(item) for item in value) + "]", "list"
    return _cedar_literal(value), _kind_of(value)


def _cedar_attr(name: str) -> str:
    return name if _IDENTIFIER.match(name) and name not in _CEDAR_RESERVED else _cedar_string(name)


def _cedar_get(expression: str, name: str) -> str:
    if _IDENTIFIER.match(name) and name not in _CEDAR_RESERVED:
        return f"{expression}.{name}"
    return f"{expression}[{_cedar_string(name)}]"


def _cedar_literal(value: Scalar) -> str:
    if value is None:
        raise PolicyError(
            "null has no Cedar equivalent: a missing or null argument already requires approval "
            "in any comparison; write the rule without null",
            0,
        )
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Decimal):
        if value != value.to_integral_value():
            raise PolicyError(
                f"{value}: Cedar compares whole numbers; write the amount in minor units "
                "(paise, cents) or round the limit",
                0,
            )
        if abs(int(value)) > _LONG_MAX:
            raise PolicyError(f"{value}: larger than Cedar's 64-bit numbers", 0)
        return str(int(value))
    return _cedar_string(value)


def _cedar_string(value: str) -> str:
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    escaped = escaped.replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r").replace("\0", "\\0")
    return f'"{escaped}"'


def _clip(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
