"""Crypto-shredding of artifacts (issue 37, part 4): their bytes are sealed with their run's data
key, kept in a key store apart from the platform's database; an erasure destroys the key, so a
copy of the row taken before (a backup, a dump) no longer opens; a pass destroys the keys a
removal could not; without the key store nothing is stored, with a clear 503."""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import importlib
import io
import uuid

import pytest
from cryptography.exceptions import InvalidTag
from cryptography.fernet import Fernet
from django.core.management import CommandError, call_command
from django.db import connection
from django.utils import timezone
from rest_framework.test import APIClient

from artifacts import services as artifacts
from artifacts.models import Artifact
from history import subjects
from history.models import ContentRemoval
from history.shredding import shred_forgotten
from history.tasks import shred_keys
from history.verify import verify
from tests import factories
from tests.history.conftest import finished_run
from tests.history.test_erasure import _erase, _pg_dump
from vault import sealing, store

pytestmark = pytest.mark.django_db(transaction=True)

CUSTOMER = "CUST-4471-XK"
IBAN = "DE89-3704-0044-0532-0130-00"  # only ever inside the artifact


def _client(user) -> APIClient:
    client = APIClient()
    client.force_authenticate(user)
    return client


def _statement(run, text: str) -> Artifact:
    body = f"customer,iban\n{text},{IBAN}\n".encode()
    return artifacts.store(
        run=run, name="statement.csv", media_type="text/csv", content=body, source="upload"
    )


def test_an_artifact_is_sealed_at_rest_and_its_key_is_kept_apart(asha, echo_agent):
    run = finished_run(asha, word="hello")
    stored = _statement(run, CUSTOMER)

    row = Artifact.objects.get(pk=stored.pk)
    assert row.sealed and IBAN.encode() not in bytes(row.content)
    assert IBAN.encode() in artifacts.content_of(row)
    download = _client(asha).get(f"/v1/artifacts/{stored.pk}/content")
    assert download.status_code == 200 and IBAN.encode() in download.content
    dump = _pg_dump()
    assert IBAN not in dump and "content_keys" not in dump  # neither the bytes nor the key
    assert store.get(run.pk) is not None
    assert store.location().rsplit("/", 1)[-1].endswith("_keys")


def test_an_erasure_destroys_the_key_so_a_copy_taken_before_no_longer_opens(asha, compliance, echo_agent):
    run = finished_run(asha, word=CUSTOMER)
    stored = _statement(run, CUSTOMER)
    with connection.cursor() as cursor:  # a backup's copy of the row
        cursor.execute("SELECT content, sealed, name FROM artifacts_artifact WHERE id = %s", [stored.pk])
        backup = dict(zip(("content", "sealed", "name"), cursor.fetchone()))

    assert _erase(compliance).status_code == 201

    assert store.get(run.pk) is None
    assert ContentRemoval.objects.get(run=run).why == "erasure"
    # The backup restored: the row is back, its bytes are not.
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE artifacts_artifact SET content = %s, sealed = %s, name = %s WHERE id = %s",
            [backup["content"], backup["sealed"], backup["name"], stored.pk],
        )
    sealing.forget_cached()  # another process: nothing kept in memory
    with pytest.raises(sealing.KeyDestroyed):
        sealing.unseal(run.pk, run.tenant_id, bytes(backup["content"]), artifacts.sealed_as(stored.pk))
    gone = _client(asha).get(f"/v1/artifacts/{stored.pk}/content")
    assert gone.status_code == 410 and gone.json()["error"]["code"] == "content_erased"
    assert str(stored.pk) not in {
        str(a) for items in subjects.find(run.tenant_id, IBAN).artifacts.values() for a in items
    }


def test_a_sealed_value_opens_only_for_its_run_and_purpose(tenant):
    one, other = uuid.uuid4(), uuid.uuid4()
    sealed = sealing.seal(one, tenant.pk, b"secret", "artifact:1")
    sealing.seal(other, tenant.pk, b"anything", "artifact:1")  # the other run has a key too
    assert sealing.unseal(one, tenant.pk, sealed, "artifact:1") == b"secret"
    with pytest.raises(sealing.KeyDestroyed):
        sealing.unseal(other, tenant.pk, sealed, "artifact:1")  # moved to another run: not its key
    with pytest.raises(InvalidTag):
        sealing.unseal(one, tenant.pk, sealed, "artifact:2")  # put in another artifact's place
    sealing.shred([one, other])


def test_the_pass_destroys_the_keys_a_removal_missed_and_those_of_runs_deleted(asha, echo_agent, settings):
    removed, live = finished_run(asha, word="a"), finished_run(asha, word="b")
    _statement(removed, "x"), _statement(live, "y")
    # A removal whose after-commit shred never ran (the key store was down, the process killed).
    ContentRemoval.objects.create(run=removed, why=ContentRemoval.Why.RETENTION)
    deleted = uuid.uuid4()  # a run deleted whole (skeleton retention, a month's partitions dropped)
    sealing.seal(deleted, removed.tenant_id, b"left behind", "artifact:1")

    # (The key store outlives each test's database: earlier tests' keys are other runs deleted.)
    assert shred_forgotten(page=1) >= 1  # a key a page
    assert settings.CELERY_BEAT_SCHEDULE["history_shred_keys"]["task"] == "history.tasks.shred_keys"
    assert shred_keys() == 0  # the beat's task: nothing left to destroy now
    assert store.get(removed.pk) is None and store.get(live.pk) is not None
    assert store.get(deleted) is not None  # young: its run may still be being created
    assert shred_forgotten(now=timezone.now() + dt.timedelta(hours=2)) >= 1
    assert store.get(deleted) is None and store.get(live.pk) is not None


def test_without_the_key_store_an_upload_is_refused_with_503_and_nothing_is_stored(
    asha, echo_agent, settings
):
    run = finished_run(asha, word="hello")
    settings.CONTENT_KEYS_DATABASE_URL = "postgresql://root@127.0.0.1:1/nowhere"
    body = {"name": "t.csv", "media_type": "text/csv", "content_b64": base64.b64encode(b"a,b\n").decode()}

    response = _client(asha).post(f"/v1/runs/{run.pk}/artifacts", body, format="json")

    assert response.status_code == 503, response.content
    error = response.json()["error"]
    assert error["code"] == "key_store_unavailable" and "key store" in error["message"]
    assert "127.0.0.1" not in error["message"] and "nowhere" not in error["message"]  # where: logged only
    assert not Artifact.objects.filter(run=run).exists()


def test_bytes_altered_or_swapped_in_the_database_are_refused_not_served(asha, echo_agent):
    run = finished_run(asha, word="hello")
    one, two = (
        _statement(run, "one"),
        artifacts.store(run=run, name="other.csv", media_type="text/csv", content=b"a,b\n", source="upload"),
    )
    # An administrator puts one artifact's sealed bytes in the other's place: same run, same key.
    Artifact.objects.filter(pk=two.pk).update(content=Artifact.objects.get(pk=one.pk).content)

    swapped = _client(asha).get(f"/v1/artifacts/{two.pk}/content")

    assert swapped.status_code == 500 and swapped.json()["error"]["code"] == "content_altered"
    assert IBAN.encode() not in swapped.content
    # Another run's sealed bytes put in place of a third artifact: unreadable here, and named.
    elsewhere = _statement(finished_run(asha, word="other"), "z")
    three = artifacts.store(
        run=run, name="third.csv", media_type="text/csv", content=b"c,d\n", source="upload"
    )
    Artifact.objects.filter(pk=three.pk).update(content=Artifact.objects.get(pk=elsewhere.pk).content)
    # Others in the clear, the flag cleared and the sha256 fitted to them: served, but named.
    forged = b"customer,iban\nother,XX00\n"
    Artifact.objects.filter(pk=one.pk).update(
        content=forged, sealed=False, sha256=hashlib.sha256(forged).hexdigest()
    )
    problems = {f.problem for f in verify([run.pk]).findings}
    assert problems == {
        f"artifact {one.pk}: its bytes are in the clear: written around the platform",
        f"artifact {two.pk}: its bytes fail their seal: edited, or another's",
        f"artifact {three.pk}: its bytes were sealed by a key this run does not hold: another run's, "
        "or restored from before an erasure this history does not record",
    }


def test_an_untouched_runs_artifacts_verify_and_those_of_an_erased_run_too(asha, compliance, echo_agent):
    kept, erased = finished_run(asha, word="hello"), finished_run(asha, word=CUSTOMER)
    _statement(kept, "x"), _statement(erased, CUSTOMER)
    assert _erase(compliance).status_code == 201
    report = verify([kept.pk, erased.pk])
    assert report.ok, [str(f) for f in report.findings]


def test_the_upgrade_seals_artifacts_stored_before_indexes_their_words_and_the_downgrade_opens_them(
    asha, echo_agent
):
    from django.apps import apps

    migration = importlib.import_module("artifacts.migrations.0004_sealed")
    run = finished_run(asha, word="hello")
    kept = _statement(run, "old")
    erased = _statement(run, "gone")
    # As they were before the upgrade: in the clear, and one emptied by an earlier erasure.
    Artifact.objects.filter(pk=kept.pk).update(content=artifacts.content_of(kept), sealed=False)
    Artifact.objects.filter(pk=erased.pk).update(content=b"", sealed=False)

    Artifact.objects.filter(run=run).update(words=[])
    migration.seal_existing(apps, None)
    importlib.import_module("artifacts.migrations.0005_words").index_words(apps, None)

    row = Artifact.objects.get(pk=kept.pk)
    assert (
        row.sealed and IBAN.encode() not in bytes(row.content) and IBAN.encode() in artifacts.content_of(row)
    )
    assert row.words == sealing.word_hashes(run.tenant_id, artifacts.words_of(artifacts.content_of(row)))
    assert not Artifact.objects.get(pk=erased.pk).sealed  # nothing to seal
    migration.open_sealed(apps, None)
    row = Artifact.objects.get(pk=kept.pk)
    assert not row.sealed and IBAN.encode() in bytes(row.content)


def test_a_new_content_key_put_in_front_rewraps_every_run_key_and_the_old_one_retires(
    asha, echo_agent, settings
):
    old, new = settings.CONTENT_KEYS[0], Fernet.generate_key().decode()
    run = finished_run(asha, word="hello")
    stored = _statement(run, "x")
    settings.CONTENT_KEYS = [new, old]
    sealing.forget_cached()

    out = io.StringIO()
    call_command("rotate_content_keys", stdout=out)

    assert "rewrapped" in out.getvalue()
    settings.CONTENT_KEYS = [new]  # the old key retired
    sealing.forget_cached()
    assert IBAN.encode() in artifacts.content_of(Artifact.objects.get(pk=stored.pk))
    out = io.StringIO()
    call_command("rotate_content_keys", stdout=out)
    assert out.getvalue().startswith("rewrapped 0 run keys")
    settings.CONTENT_KEYS = [Fernet.generate_key().decode()]  # neither: refused, named
    with pytest.raises(CommandError, match="wrapped by none of CONTENT_KEYS"):
        call_command("rotate_content_keys", stdout=io.StringIO())


def test_the_search_reads_the_artifacts_whose_keyed_words_hold_the_identifiers_and_erasure_empties_them(
    tenant,
    asha,
    compliance,
    echo_agent,
):
    run = finished_run(asha, word="hello")
    carrying = _statement(run, CUSTOMER)
    other = artifacts.store(
        run=run,
        name="notes.txt",
        media_type="text/plain",
        content=b"XK 4471 CUST, in other words",
        source="upload",
    )
    other_tenant = factories.make_tenant("globex")

    words = list(Artifact.objects.filter(pk=carrying.pk).values_list("words", flat=True))[0]
    assert sealing.word_hashes(tenant.pk, ["CUST"])[0] in words  # its words, keyed
    assert sealing.word_hashes(other_tenant.pk, ["CUST"]) != sealing.word_hashes(tenant.pk, ["CUST"])
    found = subjects.find(tenant.pk, CUSTOMER)
    # `other` holds every word of the identifier, but not the identifier: read, and not found.
    assert found.artifacts == {run.pk: [carrying.pk]}
    assert subjects.find(tenant.pk, CUSTOMER, scan=True).artifacts == found.artifacts
    assert subjects.find(tenant.pk, "UST-4471-XK").artifacts == {}  # inside a longer token

    assert _erase(compliance).status_code == 201

    assert list(Artifact.objects.filter(run=run).values_list("words", flat=True)) == [[], []]
    assert other.pk  # emptied with the rest of the run's content


def test_an_artifact_with_too_many_words_to_keep_is_read_whole_by_every_search(
    tenant, asha, echo_agent, monkeypatch
):
    monkeypatch.setattr(artifacts, "MAX_WORDS", 3)
    run = finished_run(asha, word="hello")
    stored = _statement(run, CUSTOMER)  # customer, iban, CUST, 4471, XK, DE89, ...: over 3

    assert list(Artifact.objects.filter(pk=stored.pk).values_list("words", flat=True)) == [None]
    assert subjects.find(tenant.pk, CUSTOMER).artifacts == {run.pk: [stored.pk]}


def test_the_key_store_beside_a_database_with_a_password_is_reached_with_it(settings, monkeypatch):
    from django.db import connection

    settings.CONTENT_KEYS_DATABASE_URL = ""
    monkeypatch.setitem(connection.settings_dict, "PASSWORD", "p@ss:w/rd")

    assert ":p%40ss%3Aw%2Frd@" in store.location()
    assert store.location().endswith("_keys")


def test_a_new_key_store_reached_by_many_threads_at_once_is_made_once_and_serves_them_all(settings):
    # A region's first runs: fifty starts seal their input at the same moment and find the store's
    # database (and table) missing; the threads share the process's few connections to it (a
    # worker's 128 threads once held one each, and took every connection the server allows).
    from concurrent.futures import ThreadPoolExecutor

    db = connection.settings_dict
    name = f"keys_race_{uuid.uuid4().hex[:8]}"
    settings.CONTENT_KEYS_DATABASE_URL = (
        f"postgresql://{db['USER']}@{db['HOST'] or '127.0.0.1'}:{db['PORT']}/{name}"
    )
    ids = [str(uuid.uuid4()) for _ in range(16)]
    try:
        with ThreadPoolExecutor(16) as pool:
            stored = list(pool.map(lambda run_id: store.put(run_id, "t", b"wrapped-" + run_id.encode()), ids))
            with connection.cursor() as cursor:  # the threads are alive still, with whatever they hold
                cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s", [name])
                (held,) = cursor.fetchone()
        assert stored == [b"wrapped-" + run_id.encode() for run_id in ids]
        assert 1 <= held <= settings.CONTENT_KEYS_POOL_MAX
    finally:
        store.drop_database()


def test_a_connection_in_use_when_the_store_is_closed_is_closed_when_given_back(transactional_db):
    import threading

    where = store.location()
    store.get("warm")  # the process's pool made
    taken, release, held = threading.Event(), threading.Event(), []

    def hold():
        with store._pool(where).connection() as conn:
            held.append(conn)
            taken.set()
            release.wait(10)

    thread = threading.Thread(target=hold)
    thread.start()
    assert taken.wait(10)
    store.close(where)
    release.set()
    thread.join(10)
    assert held[0].closed  # not kept in the closed pool's idle list, left to garbage collection
    assert store.get("warm") is None  # a new pool serves on


def test_two_writers_of_one_runs_key_both_get_the_first_one_stored(transactional_db):
    run_id = str(uuid.uuid4())
    assert store.put(run_id, "t", b"first") == b"first"
    assert store.put(run_id, "t", b"second") == b"first"  # the loser seals with the winner's key
    assert store.held(run_id) == (b"first", "t")
    store.destroy([run_id])
    assert store.put(run_id, "t", b"third") == b"third"  # after an erasure: a new key, not the old one


def test_a_file_stored_after_another_process_destroyed_the_runs_key_gets_a_new_one(asha, echo_agent):
    run = finished_run(asha, word="hello")
    first = _statement(run, "x")
    assert IBAN.encode() in artifacts.content_of(first)  # this process now holds the key
    store.destroy([run.pk])  # another process's erasure: this one's cache is not told

    later = artifacts.store(
        run=run, name="later.csv", media_type="text/csv", content=b"a,b\n", source="upload"
    )

    sealing.forget_cached()
    assert artifacts.content_of(Artifact.objects.get(pk=later.pk)) == b"a,b\n"  # a new key: it opens
    with pytest.raises(artifacts.ContentErased):
        artifacts.content_of(Artifact.objects.get(pk=first.pk))  # the old one is gone for good
