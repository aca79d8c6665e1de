"""A run's input and metadata sealed at rest, and the run search over keyed lexemes
(vault/keyed_search.py): nothing of them is in the clear in the row, yet words, phrases, values
and ranks find the run as PostgreSQL's own full-text search would; an operator searches every
tenant; an erasure takes the run out of the search."""

from __future__ import annotations

import json

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.test import Client
from rest_framework.test import APIClient

from history import subjects
from history.verify import verify
from runs.models import Run
from runs.services import start_run
from tests import factories
from vault import keyed_search, sealing, store

pytestmark = pytest.mark.django_db

INPUT = {
    "request": "Customer reports a duplicate charge at Croma for order 7781",
    "customer_name": "Meera Sharma",
    "transaction_id": "TXN-7781",
    "amount": 12.50,
}
METADATA = {"ticket": "DSP-9031", "channel": "phone"}


def api(user) -> APIClient:
    client = APIClient()
    client.force_authenticate(user)
    return client


def found(user, q: str) -> set[str]:
    response = api(user).get("/v1/runs", {"q": q})
    assert response.status_code == 200, response.content
    return {row["id"] for row in response.json()["results"]}


@pytest.fixture
def run(tenant, asha, builtins):
    factories.make_agent(tenant, name="disputes", tools=[builtins["echo"]], turns=[{"text": "hi"}])
    made, _ = start_run(user=asha, agent="disputes", input=INPUT, metadata=METADATA)
    return made


def _row(run) -> tuple:
    with connection.cursor() as cursor:
        cursor.execute("SELECT input, metadata, search_words::text FROM runs_run WHERE id = %s", [run.pk])
        return cursor.fetchone()


def test_input_and_metadata_are_sealed_and_the_search_holds_only_keyed_lexemes(run, asha):
    stored_input, stored_metadata, words = _row(run)
    for value in (bytes(stored_input), bytes(stored_metadata)):
        assert value[:1] == sealing.VALUE_VERSION
        assert b"Meera" not in value and b"DSP-9031" not in value and b"Croma" not in value
    # Neither a word nor a value in the clear, nor PostgreSQL's own lexeme of one.
    for plain in ("meera", "sharma", "croma", "duplic", "charg", "txn", "7781", "dsp", "phone", "12.5"):
        assert plain not in words, words
    assert len(words.split()) >= 15  # the words and values are there, hashed
    # Read back opened, through the ORM and the API.
    again = Run.objects.get(pk=run.pk)
    assert (again.input, again.metadata) == (INPUT, METADATA)
    assert api(asha).get(f"/v1/runs/{run.pk}").json()["input"] == INPUT
    # And found: by words (stemmed, any order, any case), a phrase, a value, a number.
    for q in (
        "meera",
        "SHARMA Meera",
        "duplicate charges",
        '"duplicate charge"',
        "croma -refund",
        "TXN-7781",
        "DSP-9031",
        "12.5",
        "12.50",
        "phone",
    ):
        assert found(asha, q) == {str(run.pk)}, q
    for q in ('"charge duplicate"', "meera -croma", "TXN-778", "12.51", "Customer-7781"):
        assert found(asha, q) == set(), q
    assert verify([run.pk]).ok


def test_without_the_key_store_a_start_is_refused_with_503_and_nothing_is_written(
    tenant, asha, builtins, settings
):
    # The input is sealed and its words keyed when the run is created: both need the key store.
    factories.make_agent(tenant, name="disputes", tools=[builtins["echo"]], turns=[{"text": "hi"}])
    sealing.forget_cached()
    settings.CONTENT_KEYS_DATABASE_URL = "postgresql://root@127.0.0.1:1/nowhere"

    response = api(asha).post("/v1/runs", {"agent": "disputes", "input": INPUT}, format="json")

    assert response.status_code == 503, response.content
    error = response.json()["error"]
    assert error["code"] == "key_store_unavailable" and "nowhere" not in error["message"]
    assert not Run.objects.exists()


def test_the_data_subject_search_opens_input_and_metadata(run):
    assert subjects.find(run.tenant_id, "DSP-9031", scan=True).runs == {run.pk}
    assert subjects.find(run.tenant_id, "TXN-7781", scan=True).runs == {run.pk}


def test_a_value_written_in_the_clear_is_refused(run):
    with pytest.raises(TypeError, match="sealed at rest"):
        Run.objects.filter(pk=run.pk).update(input={"request": "plain"})
    with pytest.raises(TypeError, match="cannot search"):
        list(Run.objects.filter(metadata__ticket="DSP-9031"))


def test_an_operator_searches_every_tenant_and_a_tenant_only_its_own(run, tenant, asha, transactional_db):
    other = factories.make_tenant("globex")
    olga = factories.make_user(other, "olga", staff=True)
    factories.make_agent(other, name="disputes", tools=[], turns=[{"text": "hi"}])
    theirs, _ = start_run(user=olga, agent="disputes", input={"customer_name": "Meera Rao"})
    # The same word is a different lexeme in each tenant: each tenant's key.
    assert not set(_row(run)[2].split()) & set(_row(theirs)[2].split())

    assert found(asha, "meera") == {str(run.pk)}
    assert found(olga, "meera") == {str(theirs.pk)}
    operator = get_user_model().objects.create_superuser("ops", password="pw")
    client = Client()
    client.force_login(operator)
    listed = client.get("/admin/runs/run/", {"q": "meera"}).context["cl"].result_list
    assert {r.pk for r in listed} == {run.pk, theirs.pk}

    # Ranked as each tenant ranks its own: "duplicate charge" side by side beats the words far
    # apart, though the second says "duplicate" four times (ranked as an OR of the words, it won).
    near, _ = start_run(user=asha, agent="disputes", input={"request": "duplicate charge"})
    far_text = "duplicate duplicate duplicate duplicate " + " ".join(f"w{n}" for n in range(20)) + " charge"
    far, _ = start_run(user=asha, agent="disputes", input={"request": far_text})
    start_run(user=olga, agent="disputes", input={"request": "duplicate charge"})
    own = [row["id"] for row in api(asha).get("/v1/runs", {"q": "duplicate charge"}).json()["results"]]
    assert own.index(str(near.pk)) < own.index(str(far.pk))
    listed = client.get("/admin/runs/run/", {"q": "duplicate charge"}).context["cl"].result_list
    ranked = [r.pk for r in listed if r.pk in (near.pk, far.pk)]
    assert ranked == [near.pk, far.pk]


def test_a_search_makes_no_word_key_for_a_tenant_without_one(run, asha, transactional_db):
    """The query side only reads word keys: an operator's search over every tenant once made a key
    in the store for each tenant that had none (a write for every read, and keys nothing uses)."""
    idle = factories.make_tenant("initech")  # no runs: no words, no word key
    operator = get_user_model().objects.create_superuser("ops", password="pw")
    client = Client()
    client.force_login(operator)
    for q in ("meera", "-meera", '"duplicate charge"'):
        response = client.get("/admin/runs/run/", {"q": q})
        assert response.status_code == 200
    assert {r.pk for r in client.get("/admin/runs/run/", {"q": "meera"}).context["cl"].result_list} == {
        run.pk
    }
    assert store.held(f"{sealing.WORDS_KEY}{idle.pk}") is None
    assert keyed_search.tsquery([idle.pk], keyed_search.parse("meera")) == "''"
    assert keyed_search.matcher(idle.pk, keyed_search.parse("meera"))(None) is False
    assert store.held(f"{sealing.WORDS_KEY}{idle.pk}") is None
    # Its first run makes the key, and the search finds that run.
    olga = factories.make_user(idle, "olga", staff=True)
    factories.make_agent(idle, name="disputes", tools=[], turns=[{"text": "hi"}])
    theirs, _ = start_run(user=olga, agent="disputes", input={"customer_name": "Meera Iyer"})
    assert store.held(f"{sealing.WORDS_KEY}{idle.pk}") is not None
    listed = client.get("/admin/runs/run/", {"q": "meera"}).context["cl"].result_list
    assert {r.pk for r in listed} == {run.pk, theirs.pk}


# Documents and searches whose words PostgreSQL's parser splits as the platform does (letters and
# digits between spaces): the keyed search must decide as `to_tsvector @@ websearch_to_tsquery`.
DOCUMENTS = [
    {"request": "Refund of money never arrived", "customer_name": "Meera Sharma"},
    {"request": "refund money", "note": "the charges were duplicated twice"},
    {"request": "duplicate charge", "ticket": "duplicate charge", "amount": 12499},
    {"request": "Close the account", "lines": [{"sku": "money"}, {"sku": "refund"}]},
    {"request": "Customer says the card was stolen and money is missing"},
    {"request": "stolen card", "customer_name": "Ravi Duplicate Kumar", "count": 3},
]
SEARCHES = [
    "refund",
    "refunds money",
    '"refund of money"',
    '"refund money"',
    '"money refund"',
    "duplicate charge",
    '"duplicate charge"',
    "duplicate -charge",
    "-refund",
    "refund or stolen",
    "meera or ravi kumar",
    "meera ravi or card",
    '"the card was stolen"',
    '"card stolen"',
    "the",
    "of the",
    "or",
    '"unclosed refund',
    "- refund",
    'money -"refund of money"',
    "12499",
    "3",
    "Stolen CARD",
    "charges",
    "twice duplicated",
]


def _scalars(value) -> list:
    if isinstance(value, dict):
        return [s for v in value.values() for s in _scalars(v)]
    if isinstance(value, list):
        return [s for v in value for s in _scalars(v)]
    return [value]


def test_keyed_matching_decides_as_postgresql_full_text_search(tenant):
    documents = [keyed_search.document(tenant.pk, d) for d in DOCUMENTS]
    disagreements = []
    with connection.cursor() as cursor:
        for q in SEARCHES:
            parsed = keyed_search.parse(q)
            query = keyed_search.tsquery([tenant.pk], parsed)
            matcher = keyed_search.matcher(tenant.pk, parsed)
            for plain, keyed in zip(DOCUMENTS, documents, strict=True):
                cursor.execute(
                    "SELECT jsonb_to_tsvector('english', %s::jsonb, '[\"string\"]') "
                    "@@ websearch_to_tsquery('english', %s), %s::tsvector @@ %s::tsquery",
                    [json.dumps(plain), q, keyed, query],
                )
                words, ours = cursor.fetchone()
                number = keyed_search.NUMBER.match(q) and float(q)
                value = q in _scalars(plain) or any(
                    number is not None and number is not False and v == number
                    for v in _scalars(plain)
                    if not isinstance(v, str)
                )
                expected = bool(words) or value
                if (ours, matcher(keyed)) != (expected, expected):
                    disagreements.append((q, plain, expected, ours, matcher(keyed)))
    assert disagreements == [], "\n".join(map(str, disagreements))


def test_ranking_over_keyed_lexemes_orders_as_over_words(tenant):
    # ts_rank counts lexemes and their distances: the hashes keep both, so the order is the same.
    documents = [keyed_search.document(tenant.pk, d) for d in DOCUMENTS]
    parsed = keyed_search.parse("duplicate charge")
    query = keyed_search.tsquery([tenant.pk], parsed, values=False)  # as the search ranks
    with connection.cursor() as cursor:
        ranks = []
        for plain, keyed in zip(DOCUMENTS, documents, strict=True):
            cursor.execute(
                "SELECT ts_rank(jsonb_to_tsvector('english', %s::jsonb, '[\"string\"]'), "
                "websearch_to_tsquery('english', 'duplicate charge')), ts_rank(%s::tsvector, %s::tsquery)",
                [json.dumps(plain), keyed, query],
            )
            ranks.append(cursor.fetchone())
    assert [round(plain, 5) for plain, _ in ranks] == [round(ours, 5) for _, ours in ranks]
    assert ranks[2][1] > ranks[1][1] > 0  # twice beats once
