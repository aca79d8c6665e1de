"""Fuzzing the model's side (issue 28): whatever tool names and arguments a model server sends
(platform tools, unknown tools, wrong types, huge numbers, NUL, lone surrogates, deep nesting,
arguments that are not JSON), every run reaches a terminal or waiting state and no engine task
raises (the engine records what would have raised as an `engine_error` event: there is none).

The calls come over the real OpenAI-compatible wire from a local fake server (the network edge),
so they pass through the same parsing a hosted or self-hosted model's reply does.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from runs.models import TERMINAL, WAITING, RunEvent, Step
from runs.services import start_run
from tests import factories
from tests.conftest import drive
from tests.fakes.model_servers import FakeOpenAI

pytestmark = pytest.mark.django_db(transaction=True)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
    st.just("\x00nul\x00"),
    st.just("\ud800 lone surrogate"),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def deeply_nested(draw):
    depth = draw(st.integers(min_value=30, max_value=120))
    value = draw(scalars)
    for _ in range(depth):
        value = {"a": value} if draw(st.booleans()) else [value]
    return value


arguments = st.one_of(
    st.dictionaries(st.sampled_from(["step", "offset", "query", "blob", "x"]), values, max_size=3),
    st.fixed_dictionaries({"step": st.integers(min_value=-(10**15), max_value=10**15)}),
    st.fixed_dictionaries(
        {"step": st.integers(min_value=0, max_value=3), "offset": st.integers(min_value=-5, max_value=10**13)}
    ),
    deeply_nested(),
    values,
    st.text(max_size=60),  # not JSON at all, or JSON that is not an object
)
names = st.one_of(
    st.sampled_from(["read_result", "search_tools", "platform__echo", "transfer_funds", ""]),
    st.text(max_size=300),
)


@pytest.fixture
def model(tenant, asha, builtins):
    fake = FakeOpenAI(min_cacheable_tokens=0)
    fake.start()
    echo = builtins["echo"]
    factories.grant(echo, use=[asha])
    endpoint = factories.make_endpoint(tenant, name="gpt", kind="openai", base_url=fake.base_url)
    factories.make_agent(tenant, endpoint=endpoint, tools=[echo], context={"result_limit_chars": 50})
    yield fake
    fake.stop()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(calls=st.lists(st.tuples(names, arguments), min_size=1, max_size=3))
# Found by this test: a number past Cedar's 64 bits for a tool with no approval rule was sent
# for approval (the `never` rule's empty conversion was still evaluated).
@example(calls=[("platform__echo", {"step": 9.22337203845825e18})])
def test_whatever_the_model_sends_the_run_ends_or_waits_and_nothing_raises(model, asha, calls):
    with model._lock:  # what an earlier example left queued (a run that stopped early)
        model._queue.clear()
    model.queue(
        # A first call with a long result, so that read_result is offered and has something to page.
        {"tool_calls": [{"name": "platform__echo", "arguments": {"blob": "x" * 500}}]},
        {"tool_calls": [{"name": name, "arguments": args} for name, args in calls]},
        {"text": "done"},
    )
    run, _ = start_run(user=asha, agent="agent", input={"case": 1})
    run = drive(run.pk, max_tasks=60)
    assert run.status in TERMINAL | WAITING, run.status
    errors = list(RunEvent.objects.filter(run=run, kind="engine_error").values_list("message", flat=True))
    assert errors == []
    for step in Step.objects.filter(run=run, kind="tool"):
        assert step.status in ("succeeded", "failed", "denied", "skipped"), (step.tool_name, step.status)
        if step.status in ("failed", "denied"):
            assert step.observation.startswith("ERROR: ")  # the model is told why
