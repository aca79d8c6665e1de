"""Finding runs: `GET /v1/runs` by id prefix, input and metadata values, creator, agent, status and date;
the same search in the admin; the indexes PostgreSQL uses for it."""

from __future__ import annotations

import datetime as dt

import pytest
from django.db import connection
from django.utils import timezone
from rest_framework.test import APIClient

from runs.front.display import run_title
from runs.front.search import DENSE_MIN, id_range, search
from runs.models import Run
from runs.services import start_run
from tests import factories
from vault import keyed_search

pytestmark = pytest.mark.django_db


def api(user) -> APIClient:
    client = APIClient()
    client.force_authenticate(user)
    return client


@pytest.fixture
def runs(tenant, asha, ravi, builtins):
    factories.make_agent(tenant, name="disputes", tools=[builtins["echo"]], turns=[{"text": "hi"}])
    factories.make_agent(tenant, name="refunds", tools=[builtins["echo"]], turns=[{"text": "hi"}])
    made = {}
    for name, user, agent, body, metadata in [
        ("a", asha, "disputes", {"transaction_id": "TXN-1001", "amount": 12499}, {"ticket": "DSP-1"}),
        ("b", asha, "refunds", {"transaction_id": "TXN-1002", "lines": [{"sku": "TV-55"}]}, {}),
        ("c", ravi, "disputes", {"transaction_id": "TXN-1003"}, {"ticket": "TXN-1002"}),
    ]:
        made[name], _ = start_run(user=user, agent=agent, input=body, metadata=metadata)
    return made


def ids(response) -> set[str]:
    assert response.status_code == 200, response.content
    return {row["id"] for row in response.json()["results"]}


def test_it_finds_runs_by_a_value_anywhere_in_input_or_metadata(ravi, runs):
    found = ids(api(ravi).get("/v1/runs", {"q": "TXN-1002"}))
    assert found == {str(runs["b"].pk), str(runs["c"].pk)}  # b's input, c's metadata
    assert ids(api(ravi).get("/v1/runs", {"q": "TV-55"})) == {str(runs["b"].pk)}  # nested
    assert ids(api(ravi).get("/v1/runs", {"q": "12499"})) == {str(runs["a"].pk)}  # a number
    assert ids(api(ravi).get("/v1/runs", {"q": "TXN-100"})) == set()  # values match exactly


def test_it_finds_a_run_by_its_id_or_an_id_prefix(ravi, runs):
    run = runs["a"]
    assert str(run.pk) in ids(api(ravi).get("/v1/runs", {"q": str(run.pk)[:6]}))
    assert ids(api(ravi).get("/v1/runs", {"q": str(run.pk)})) == {str(run.pk)}
    assert ids(api(ravi).get("/v1/runs", {"q": str(run.pk).upper()})) == {str(run.pk)}


def test_it_combines_creator_agent_status_and_date(ravi, runs):
    assert ids(api(ravi).get("/v1/runs", {"created_by": "asha", "agent": "disputes"})) == {str(runs["a"].pk)}
    assert ids(api(ravi).get("/v1/runs", {"q": "TXN-1002", "created_by": "ravi"})) == {str(runs["c"].pk)}
    Run.objects.filter(pk=runs["a"].pk).update(created_at=timezone.now() - dt.timedelta(days=3))
    since = (timezone.now() - dt.timedelta(days=1)).isoformat()
    assert ids(api(ravi).get("/v1/runs", {"created_after": since})) == {str(runs["b"].pk), str(runs["c"].pk)}
    assert ids(api(ravi).get("/v1/runs", {"created_before": since})) == {str(runs["a"].pk)}
    status = Run.objects.get(pk=runs["a"].pk).status
    assert str(runs["a"].pk) in ids(api(ravi).get("/v1/runs", {"status": status}))


def test_a_user_without_view_runs_finds_only_their_own(asha, runs):
    assert ids(api(asha).get("/v1/runs", {"q": "TXN-1002"})) == {str(runs["b"].pk)}


def test_bad_filters_are_field_errors(ravi, runs):
    response = api(ravi).get("/v1/runs", {"created_after": "yesterday", "q": "x" * 201})
    assert response.status_code == 400
    fields = response.json()["error"]["fields"]
    assert set(fields) == {"created_after", "q"}


def test_the_admin_search_box_uses_the_same_search(runs, tenant):
    from tests.admin.helpers import make_supervisor

    client = __import__("django.test", fromlist=["Client"]).Client()
    client.force_login(make_supervisor(tenant, "sara"))
    response = client.get("/admin/runs/run/", {"q": "TXN-1002"})
    assert response.status_code == 200
    shown = {str(run.pk) for run in response.context["cl"].result_list}
    assert shown == {str(runs["b"].pk), str(runs["c"].pk)}
    assert "disputes · TXN-1003 · ravi" in response.content.decode()


def test_a_runs_title_names_agent_key_value_and_creator(runs):
    assert run_title(Run.objects.get(pk=runs["a"].pk)) == "disputes · TXN-1001 · asha"


def test_an_id_prefix_is_a_range_of_the_primary_key():
    low, high = id_range("A739-0f")
    assert str(low) == "a7390f00-0000-0000-0000-000000000000"
    assert str(high) == "a7390fff-ffff-ffff-ffff-ffffffffffff"
    assert id_range("a73") is None and id_range("TXN-1") is None


def test_postgres_uses_the_words_index_for_a_value_search(runs, tenant):
    # With sequential scans off, a plan that still scans the table means the index cannot serve
    # the query. Unordered: ordered by created_at, the planner may walk that index backwards and
    # filter. Values are keyed lexemes of the same tsvector as words (migration 0029).
    queryset = search(Run.objects.all(), "TXN-1002", tenants=[tenant.pk]).order_by()
    sql, params = queryset.query.sql_with_params()
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute(f"EXPLAIN {sql}", params)
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "run_search_words" in plan, plan


def test_a_search_inside_a_subquery_names_its_own_table(runs, tenant):
    # The inbox filters approvals by the runs a search finds: the runs table is joined twice.
    from approvals.models import Approval

    inner = search(Run.objects.filter(tenant=tenant), "TXN-1002", tenants=[tenant.pk]).values("pk")
    assert list(Approval.objects.select_related("run").filter(run_id__in=inner)) == []
    assert {r.pk for r in Run.objects.filter(pk__in=inner).select_related("tenant")} == {
        runs["b"].pk,
        runs["c"].pk,
    }


@pytest.fixture
def requests(tenant, asha, ravi, builtins):
    factories.make_agent(tenant, name="disputes", tools=[builtins["echo"]], turns=[{"text": "hi"}])
    made = {}
    for name, body, metadata in [
        (
            "meera",
            {"request": "Customer disputes a duplicate charge at Croma", "customer_name": "Meera Sharma"},
            {"ticket_subject": "Duplicate charge"},
        ),
        (
            "ravi",
            {"request": "Refund the duplicate charges on the card", "customer_name": "Ravi Duplicate Kumar"},
            {},
        ),
        (
            "arjun",
            {"request": "Close the account", "customer_name": "Arjun Mehta"},
            {"ticket_subject": "Closure"},
        ),
    ]:
        made[name], _ = start_run(user=asha, agent="disputes", input=body, metadata=metadata)
    return made


def test_it_finds_runs_by_words_of_the_request_and_the_customer(ravi, requests):
    assert ids(api(ravi).get("/v1/runs", {"q": "meera"})) == {str(requests["meera"].pk)}  # a name, any case
    assert ids(api(ravi).get("/v1/runs", {"q": "sharma meera"})) == {str(requests["meera"].pk)}  # any order
    assert ids(api(ravi).get("/v1/runs", {"q": "closure"})) == {str(requests["arjun"].pk)}  # metadata
    # Every word must be there; English stems: "charge" finds "charges".
    assert ids(api(ravi).get("/v1/runs", {"q": "duplicate charge"})) == {
        str(requests["meera"].pk),
        str(requests["ravi"].pk),
    }
    assert ids(api(ravi).get("/v1/runs", {"q": "duplicate charge -refund"})) == {str(requests["meera"].pk)}
    assert ids(api(ravi).get("/v1/runs", {"q": "meera account"})) == set()


def test_word_matches_come_best_first(ravi, requests):
    # Meera's run says "duplicate charge" twice (request and ticket subject), Ravi's once, and
    # Ravi's is newer: ranked, Meera's comes first.
    rows = api(ravi).get("/v1/runs", {"q": "duplicate charge"}).json()["results"]
    assert [row["id"] for row in rows] == [str(requests["meera"].pk), str(requests["ravi"].pk)]
    # Without words the newest come first, as always.
    rows = api(ravi).get("/v1/runs").json()["results"]
    assert rows[0]["id"] == str(requests["arjun"].pk)


def test_the_admin_search_box_finds_words_best_first(requests, tenant):
    from django.test import Client

    from tests.admin.helpers import make_supervisor

    client = Client()
    client.force_login(make_supervisor(tenant, "sara"))
    shown = [
        run.pk for run in client.get("/admin/runs/run/", {"q": "duplicate charge"}).context["cl"].result_list
    ]
    assert shown == [requests["meera"].pk, requests["ravi"].pk]


def test_postgres_uses_the_words_index_for_a_word_search(requests, tenant):
    # As for values: with sequential scans off, a plan without the index means the query's
    # expression no longer matches the index's (migrations 0021, 0029).
    queryset = search(Run.objects.all(), "meera sharma", tenants=[tenant.pk]).order_by()
    sql, params = queryset.query.sql_with_params()
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute(f"EXPLAIN {sql}", params)
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "run_search_words" in plan, plan


def _many_runs(template: Run, request: str, orders, **fields) -> None:
    """Runs like `template`, one per order number in `orders` (the last one the newest), whose
    request is `request` with its order number."""
    Run.objects.bulk_create(
        Run(
            tenant=template.tenant,
            created_by=template.created_by,
            agent=template.agent,
            version=template.version,
            input={"request": request.format(order)},
            search_words=keyed_search.document(template.tenant_id, {"request": request.format(order)}),
            **fields,
        )
        for order in orders
    )


def test_past_a_thousand_matches_the_count_is_an_estimate_and_next_stays_exact(ravi, requests):
    # 5,030 more runs whose request says "chargeback": counting them all is what a common word
    # at a million runs cannot afford (the answer says its count is an estimate), and their page
    # is read walking the newest runs; `next` still ends exactly at the last page.
    _many_runs(
        requests["meera"],
        "Customer asks for a chargeback on order {}",
        reversed(range(DENSE_MIN + 30)),  # order 0 the newest
        status="succeeded",
    )
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE runs_run")
    first = api(ravi).get("/v1/runs", {"q": "chargeback", "limit": 200}).json()
    assert first["count_exact"] is False and first["count"] > 1000
    assert len(first["results"]) == 200 and first["next"] is not None
    orders = [row["input"]["request"].rsplit(" ", 1)[1] for row in first["results"]]
    assert orders == [str(n) for n in range(200)]  # the newest first
    last = api(ravi).get("/v1/runs", {"q": "chargeback", "limit": 200, "offset": DENSE_MIN}).json()
    assert len(last["results"]) == 30 and last["next"] is None
    assert last["count"] >= DENSE_MIN + 30  # never below what the pages show exists
    full = api(ravi).get("/v1/runs", {"q": "chargeback", "limit": 200, "offset": DENSE_MIN - 200}).json()
    assert len(full["results"]) == 200 and full["next"] is not None  # 30 more after it
    # At most a thousand: counted, exact; a page that ends the list has no next.
    few = api(ravi).get("/v1/runs", {"q": "duplicate charge", "limit": 1}).json()
    assert (few["count"], few["count_exact"], len(few["results"])) == (2, True, 1)
    assert few["next"] is not None
    assert api(ravi).get("/v1/runs", {"q": "duplicate charge", "offset": 1}).json()["next"] is None


def test_a_word_in_many_runs_is_read_walking_the_newest_runs(ravi, requests):
    from core.api import planner_settings

    template = requests["meera"]
    _many_runs(template, "wrong amount debited on order {}", range(DENSE_MIN + 1))
    found = search(
        Run.objects.filter(tenant=template.tenant),
        "wrong amount debited",
        tenants=[template.tenant_id],
        ranked=True,
    )
    assert found.page_settings["enable_bitmapscan"] == "off"
    sql, params = found.order_by("-created_at")[:51].query.sql_with_params()
    with planner_settings(found.page_settings), connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN {sql}", params)
        plan = "\n".join(row[0] for row in cursor.fetchall())
    # The (tenant, created_at) index, newest first, filtering: neither words index nor sort.
    assert "Index Scan" in plan and "Bitmap" not in plan and "Sort" not in plan, plan
    # The admin's list: the newest first, its count an estimate past a thousand (not counted).
    from django.test import Client

    from tests.admin.helpers import make_supervisor

    client = Client()
    client.force_login(make_supervisor(template.tenant, "sara"))
    listed = client.get("/admin/runs/run/", {"q": "wrong amount debited"}).context["cl"]
    assert listed.result_count > 1000 and isinstance(listed.result_list, list)
    assert listed.result_list[0].input["request"] == f"wrong amount debited on order {DENSE_MIN}"
    # A rare word keeps the planner's own choice (the words index).
    assert not hasattr(
        search(Run.objects.all(), "meera", tenants=[template.tenant_id], ranked=True), "page_settings"
    )


def test_planner_settings_end_with_their_block_inside_a_callers_transaction():
    from core.api import planner_settings

    def seqscan() -> str:
        with connection.cursor() as cursor:
            cursor.execute("SHOW enable_seqscan")
            return cursor.fetchone()[0]

    assert connection.in_atomic_block and seqscan() == "on"  # the test's own transaction
    with planner_settings({"enable_seqscan": "off"}):
        assert seqscan() == "off"
    assert seqscan() == "on"
