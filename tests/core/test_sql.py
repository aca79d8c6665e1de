"""core.sql: the engine's prepared statements, as Django's own cursors behave."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from core import sql
from runs.models import Step, StepKind, StepStatus
from runs.services import start_run
from tests import factories

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_query_log_shows_each_prepared_statement_as_sent(tenant, asha):
    """With DEBUG's log on (tests, bench/engine.py's statement count, the debug toolbar), a prepared
    read or INSERT is logged by its text, not as None."""
    factories.make_agent(tenant, turns=[{"text": "done"}])
    run, _ = start_run(user=asha, agent="agent", input={})
    with CaptureQueriesContext(connection) as queries:
        with sql.prepared_cursor() as cursor:
            cursor.execute("SELECT %(n)s::int + 1", {"n": 41})
            assert cursor.fetchone() == (42,)
        sql.insert(
            [Step(run=run, seq=1, kind=StepKind.MODEL, status=StepStatus.SUCCEEDED, result={"text": "x"})]
        )
    logged = [query["sql"] for query in queries.captured_queries]
    assert logged[0] == "SELECT %(n)s::int + 1"
    assert logged[1].startswith(f'INSERT INTO "{Step._meta.db_table}"'), logged
    assert Step.objects.filter(run=run, seq=1).exists()
