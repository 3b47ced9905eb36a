"""Schemathesis against `jaxgpt serve` on 127.0.0.1: requests generated from the server's own OpenAPI document
(valid and invalid ones) get no 500 and only statuses, content types and bodies that the document declares.

The examples are derandomized (hypothesis draws the same ones every run): drawn anew each run, a rare draw failed
one run in about a dozen. A run of 400 examples per operation found it: a valid streamed chat request, whose
server-sent events the document did not declare as a 200's content type (it does now)."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
pytest.importorskip("jinja2")

from helpers.server import KEY, TEMPLATE, Server  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

from jaxgpt.data.conversations import ChatTemplate  # noqa: E402

AUTH = {"Authorization": f"Bearer {KEY}"}
EXAMPLES = 15  # per operation and mode: the whole run stays within a few seconds


@pytest.fixture(scope="module")
def server() -> Server:
    s = Server(api_key=KEY, chat_template=ChatTemplate(TEMPLATE))
    s.client.completions.create(model="tiny", prompt="a", max_tokens=1)  # compiled before the clock starts
    yield s
    s.close()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_generated_requests_get_declared_answers(server: Server, mode: GenerationMode) -> None:
    """Every operation, a bounded number of generated requests each (schemathesis's pytest plugin does not load
    under this pytest, so hypothesis drives its strategies directly)."""
    schema = schemathesis.openapi.from_url(f"http://127.0.0.1:{server.port}/openapi.json", headers=AUTH)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/tokenize", "/metrics"}
    for operation in operations:
        if mode is GenerationMode.NEGATIVE and not list(operation.body):
            continue  # nothing to make invalid (a GET without parameters)

        @given(case=operation.as_strategy(mode))
        @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        def check(case: object) -> None:
            # positive_data_acceptance is left out: a request the schema allows may still not fit the model (its
            # prompt and max_tokens past the context, a token id past the vocabulary), which is a declared 400
            case.call_and_validate(headers=AUTH, timeout=60,
                                   excluded_checks=[schemathesis.checks.positive_data_acceptance])

        check()
