"""What presenting the user's authority can fail with, before anything is sent to the tool."""

from __future__ import annotations


class AuthorityRefused(Exception):
    """The identity provider refused to issue a token for this user (a denial: the model is told
    the IdP's reason, and the call is not sent)."""


class AuthorityUnavailable(Exception):
    """The identity provider did not answer usably (unreachable, timed out, 5xx, 429, garbled):
    nothing was sent to the tool, and the call is retried with backoff."""

    def __init__(self, message: str, *, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after
