"""Fixtures the run tests share with the budget tests: the fake model server and the counting search server."""

from tests.budgets.conftest import fake_openai, search_server  # noqa: F401  (pytest finds fixtures by name)
