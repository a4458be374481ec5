"""The Batch API's output lines (embedfleet/gateway/batch/output.py): a refused request's line
in OpenAI's shape, and a batch's usage."""

from __future__ import annotations

from embedfleet.gateway.batch.output import batch_usage, refused_record
from embedfleet.gateway.errors import APIError


def test_a_refused_request_gets_the_response_the_endpoint_would_give() -> None:
    error = APIError(400, "`input` cannot be empty", param="input", code="empty_input")
    record = refused_record("line-7", error)
    assert record["custom_id"] == "line-7" and record["error"] is None
    assert record["id"].startswith("batch_req_")
    response = record["response"]
    assert response["status_code"] == 400 and response["request_id"].startswith("req_")
    assert response["body"]["error"]["code"] == "empty_input"
    assert response["body"]["error"]["param"] == "input"


def test_usage_counts_input_tokens_only() -> None:
    usage = batch_usage(1234)
    assert (usage["input_tokens"], usage["output_tokens"], usage["total_tokens"]) == (1234, 0, 1234)
    assert usage["input_tokens_details"] == {"cached_tokens": 0}
