from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tenants.crypto import (
    REDACTED,
    SecretKeyError,
    decrypt,
    encrypt,
    generate_key,
    redact,
    redact_obj,
    rotate,
)


def test_round_trip() -> None:
    key = generate_key()
    for plaintext in ["sk-live-abc123", "", "ünïcødé ✓", "x" * 10_000]:
        token = encrypt(plaintext, [key])
        assert token != plaintext
        assert plaintext not in token or not plaintext
        assert decrypt(token, [key]) == plaintext


def test_encryption_is_randomised() -> None:
    key = generate_key()
    assert encrypt("same", [key]) != encrypt("same", [key])


def test_generate_key_is_unique_text() -> None:
    first, second = generate_key(), generate_key()
    assert isinstance(first, str) and first != second


def test_rotation_old_key_still_decrypts() -> None:
    old, new = generate_key(), generate_key()
    token = encrypt("secret", [old])
    assert decrypt(token, [new, old]) == "secret"
    # New secrets are written with the first key only.
    fresh = encrypt("fresh", [new, old])
    assert decrypt(fresh, [new]) == "fresh"
    with pytest.raises(SecretKeyError):
        decrypt(fresh, [old])


def test_rotate_reencrypts_under_first_key() -> None:
    old, new = generate_key(), generate_key()
    token = rotate(encrypt("secret", [old]), [new, old])
    assert decrypt(token, [new]) == "secret"


def test_wrong_key_raises_clear_error() -> None:
    token = encrypt("secret", [generate_key()])
    with pytest.raises(SecretKeyError, match="can decrypt"):
        decrypt(token, [generate_key(), generate_key()])


@pytest.mark.parametrize("token", ["", "not-a-token", "ünïcødé", "gAAAAA" + "A" * 100])
def test_garbage_token_raises_secret_key_error(token: str) -> None:
    with pytest.raises(SecretKeyError):
        decrypt(token, [generate_key()])


def test_no_keys_or_bad_keys() -> None:
    with pytest.raises(SecretKeyError, match="no encryption keys"):
        encrypt("x", [])
    with pytest.raises(SecretKeyError, match="not a valid Fernet key") as info:
        encrypt("x", ["short-and-wrong"])
    assert "short-and-wrong" not in str(info.value)
    with pytest.raises(SecretKeyError):
        decrypt("x", generate_key())  # type: ignore[arg-type]


def test_secret_key_error_is_a_value_error() -> None:
    assert issubclass(SecretKeyError, ValueError)


# --------------------------------------------------------------------------
# Redaction


def test_redact_every_occurrence() -> None:
    text = "key=sk-123456 again sk-123456, token=tok_abcd"
    assert redact(text, ["sk-123456", "tok_abcd"]) == f"key={REDACTED} again {REDACTED}, token={REDACTED}"


def test_short_values_are_not_redacted() -> None:
    assert redact("a1 abc abcd", ["a1", "abc", "", "abcd"]) == f"a1 abc {REDACTED}"


def test_longest_secret_wins() -> None:
    # If "pass" went first, "password123" would leak as "[REDACTED]word123".
    assert redact("x password123 y pass", ["pass", "password123"]) == f"x {REDACTED} y {REDACTED}"


def test_redaction_does_not_rematch_its_own_marker() -> None:
    assert redact("secret-value", ["secret-value", "DACT"]) == REDACTED


def test_regex_characters_are_literal() -> None:
    assert redact("a.b*c+d a_b_c_d", ["a.b*c+d"]) == f"{REDACTED} a_b_c_d"


def test_non_string_and_none_secrets_are_ignored() -> None:
    assert redact("value 12345", [None, 12345, "value"]) == f"{REDACTED} 12345"  # type: ignore[list-item]


def _one_alternation(text: str, secrets: list[str]) -> str:
    """The reference: every secret in one regular expression, longest first."""
    ordered = sorted({s for s in secrets if len(s) >= 4}, key=lambda s: (-len(s), s))
    return re.compile("|".join(map(re.escape, ordered))).sub(REDACTED, text) if ordered else text


@given(
    secrets=st.lists(st.text(alphabet="abc.*", min_size=3, max_size=8), max_size=5),
    text=st.text(alphabet="abc.* D", max_size=60),
)
def test_redaction_matches_one_alternation_of_every_secret(secrets: list[str], text: str) -> None:
    # Only the secrets found in the text enter the pattern (none or one: no pattern at all); the
    # result must be what one alternation of all of them gives, overlaps and prefixes included.
    assert redact(text, secrets) == _one_alternation(text, secrets)
    assert redact_obj({text: [text]}, secrets) == {
        _one_alternation(text, secrets): [_one_alternation(text, secrets)]
    }


def test_no_secrets_leaves_text_alone() -> None:
    assert redact("hello", []) == "hello"


def test_redact_obj_nested() -> None:
    secret = "sk-live-XYZ"
    data = {
        "headers": {"Authorization": f"Bearer {secret}"},
        "args": [secret, {"deep": [f"x{secret}y", 42, None, True]}],
        secret: "as a key",
        "tuple": (secret, 1.5),
        "count": 3,
    }
    result = redact_obj(data, iter([secret]))  # a one-shot iterator must work
    assert result == {
        "headers": {"Authorization": f"Bearer {REDACTED}"},
        "args": [REDACTED, {"deep": [f"x{REDACTED}y", 42, None, True]}],
        REDACTED: "as a key",
        "tuple": (REDACTED, 1.5),
        "count": 3,
    }
    # The input is not modified.
    assert data["headers"]["Authorization"] == f"Bearer {secret}"


def test_redact_obj_plain_values() -> None:
    assert redact_obj("my token1234", ["token1234"]) == f"my {REDACTED}"
    assert redact_obj(17, ["token1234"]) == 17
    assert redact_obj({"a": "abc"}, ["abc"]) == {"a": "abc"}
    assert redact_obj(["x"], []) == ["x"]
