"""A small typed client for onceflow's HTTP API (see GET /v1/openapi.json).

    from onceflow_client import Client
    client = Client("http://127.0.0.1:8080", token=os.environ["ONCEFLOW_TOKEN"])
    client.submit("order-42", "completion", {"model": "gpt-4o-mini", "messages": msgs}, hook_url)
    for event in client.events("order-42"):
        print(event.kind, event.data)

Errors come back as OnceflowError with the API's status, code, message and
the field at fault. Retried, at most `max_retries` times (after the
answer's Retry-After, at most 30 s, or a backoff): a read on 429, 503 or a
failed connection; a write on 429 (refused before any work) or a
connection that could not be opened (never sent), and on nothing else, so
a bulk cancel or a redrive is never done twice. Webhooks are verified with the Standard Webhooks
reference library and de-duplicated by their webhook-id (WebhookReceiver).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Union

import httpx
import httpx_sse
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

__all__ = ["Client", "Event", "OnceflowError", "WebhookReceiver"]

TERMINAL = {"acked", "dead", "cancelled"}


class OnceflowError(Exception):
    """An answer other than 2xx: `{"error": {"code", "message", "field"?}}`."""

    def __init__(self, status: int, code: str, message: str, field: Optional[str] = None):
        super().__init__(f"{status} {code}: {message}" + (f" (field {field})" if field else ""))
        self.status = status
        self.code = code
        self.message = message
        self.field = field


@dataclass(frozen=True)
class Event:
    """One event of a job's stream: `state`, `chunk` or `reset`."""

    id: int
    kind: str
    data: dict


class Client:
    """The API of one onceflow node (any node: they share the database)."""

    def __init__(
        self,
        base_url: str,
        token: Optional[str] = None,
        timeout: float = 30.0,
        max_retries: int = 3,
    ):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout)
        self.max_retries = max_retries

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        read = method == "GET"
        unsent = (httpx.TransportError,) if read else (httpx.ConnectError, httpx.ConnectTimeout)
        again = (429, 503) if read else (429,)
        attempt = 0
        while True:
            last = attempt >= self.max_retries
            try:
                response = self._http.request(method, path, **kwargs)
            except unsent:
                if last:
                    raise
                _sleep(_backoff(attempt))
                attempt += 1
                continue
            if response.status_code in again and not last:
                _sleep(_retry_after(response, attempt))
                attempt += 1
                continue
            return _answer(response)

    def wait(self, id: str, timeout: Optional[float] = None) -> dict:
        """Waits for the job to reach a final state (acked, dead or
        cancelled) and returns it; TimeoutError after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.05
        while True:
            job = self.get(id)
            if job["state"] in TERMINAL:
                return job
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"job {id} is still {job['state']} after {timeout} s")
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            time.sleep(pause if left is None else min(pause, left))
            pause = min(pause * 2, 1.0)

    def submit(
        self,
        id: str,
        workflow: str,
        input: dict,
        webhook_url: Optional[str] = None,
        *,
        priority: Optional[int] = None,
        run_at: Optional[str] = None,
        delay_ms: Optional[int] = None,
        tags: Optional[dict] = None,
        concurrency_key: Optional[str] = None,
    ) -> dict:
        """Submits a job; the same job again returns the stored one (200).

        ``concurrency_key``: at most the token's (or workflow's) limit of
        this token's jobs with the same key run at once (1 by default)."""
        body: dict = {"id": id, "workflow": workflow, "input": input}
        if webhook_url is not None:  # none: the job POSTs nothing
            body["webhook_url"] = webhook_url
        if tags:
            body["tags"] = tags
        for key, value in (
            ("priority", priority),
            ("run_at", run_at),
            ("delay_ms", delay_ms),
            ("concurrency_key", concurrency_key),
        ):
            if value is not None:
                body[key] = value
        return self._call("POST", "/v1/jobs", json=body)

    def get(self, id: str) -> dict:
        return self._call("GET", f"/v1/jobs/{_segment(id)}")

    def list(
        self,
        *,
        state: Optional[str] = None,
        workflow: Optional[str] = None,
        waiting: Union[bool, str, None] = None,
        page_size: int = 50,
    ) -> Iterator[dict]:
        """Every matching job, newest first, page after page (keyset cursor).

        ``waiting``: ``True`` for the jobs that wait, ``False`` for the others,
        or a kind (``"sleep"``, ``"signal"``, ``"approval"``, ``"children"``)."""
        params: dict = {"limit": str(page_size)}
        if state:
            params["state"] = state
        if workflow:
            params["workflow"] = workflow
        if isinstance(waiting, str):
            params["waiting"] = waiting
        elif waiting is not None:
            params["waiting"] = "true" if waiting else "false"
        while True:
            page = self._call("GET", "/v1/jobs", params=params)
            yield from page["jobs"]
            if not page.get("next_cursor"):
                return
            params["cursor"] = page["next_cursor"]

    def cancel(self, id: str, reason: Optional[str] = None) -> dict:
        return self._call("POST", f"/v1/jobs/{_segment(id)}/cancel", json=_reason(reason))

    def submit_batch(self, jobs: list) -> list:
        """Submits up to 1,000 jobs (each a `POST /v1/jobs` body) in one request.

        Returns one answer per job, in order: `{"status", "job"}` or
        `{"status", "error"}`, as a single submit would have answered it.
        """
        return self._call("POST", "/v1/jobs/batch", json={"jobs": jobs})["jobs"]

    def cancel_all(
        self,
        reason: Optional[str] = None,
        *,
        state: Optional[str] = None,
        workflow: Optional[str] = None,
        limit: Optional[int] = None,
    ) -> int:
        """Cancels the caller's live jobs, oldest first, by filter; returns how many."""
        body: dict = _reason(reason) or {}
        for key, value in (("state", state), ("workflow", workflow), ("limit", limit)):
            if value is not None:
                body[key] = value
        return self._call("POST", "/v1/jobs/cancel", json=body)["cancelled"]

    def rerun(self, id: str, new_id: str) -> dict:
        """Runs job `id`'s workflow again on its input as job `new_id` (idempotent by it)."""
        return self._call("POST", f"/v1/jobs/{_segment(id)}/rerun", json={"id": new_id})

    def redrive(self, id: str, reason: Optional[str] = None, confirm_unknown: bool = False) -> dict:
        params = {"confirm_unknown": "true"} if confirm_unknown else None
        return self._call(
            "POST", f"/v1/jobs/{_segment(id)}/redrive", json=_reason(reason), params=params
        )

    def signal(self, id: str, name: str, signal_id: str, payload: Any, until: Optional[str] = None) -> dict:
        """Sends job `id` the signal `name`, recorded once under `signal_id`.

        With `until` (a wait's `waiting["until"]`), it is recorded only while
        the job waits for `name` with that due time (else 409 `not_waiting`).
        """
        body: dict = {"id": signal_id, "payload": payload}
        if until is not None:
            body["until"] = until
        return self._call(
            "POST",
            f"/v1/jobs/{_segment(id)}/signals/{_segment(name)}",
            json=body,
        )

    def events(self, id: str, last_event_id: Optional[int] = None, reconnects: int = 5) -> Iterator[Event]:
        """The job's events as they are journaled, from after `last_event_id`.

        A dropped connection is resumed with `Last-Event-ID`, so nothing is
        lost or repeated; the iteration ends after the job's final state,
        or at once (204) when resumed past the end of a finished job.
        """
        last = last_event_id
        failures = 0
        while True:
            headers = {"Last-Event-ID": str(last)} if last is not None else {}
            try:
                with httpx_sse.connect_sse(
                    self._http, "GET", f"/v1/jobs/{_segment(id)}/events", headers=headers,
                    timeout=httpx.Timeout(self._http.timeout.connect, read=None),
                ) as source:
                    if source.response.status_code == 204:
                        return
                    if source.response.status_code != 200:
                        source.response.read()
                        _answer(source.response)
                    for sse in source.iter_sse():
                        event = Event(int(sse.id), sse.event, json.loads(sse.data))
                        last = event.id
                        failures = 0
                        yield event
                        if event.kind == "state" and event.data.get("text") in TERMINAL:
                            return
                # Ended before the final state (a restart, a proxy's
                # timeout): resumed after `last`; a finished job says 204.
                failures += 1
                if failures > reconnects:
                    raise httpx.RemoteProtocolError("the event stream kept ending early")
                time.sleep(_backoff(failures - 1))
            except httpx.TransportError:
                failures += 1
                if failures > reconnects:
                    raise
                time.sleep(_backoff(failures - 1))


class WebhookReceiver:
    """Verifies onceflow's webhooks (Standard Webhooks) and drops repeats.

    `receive(body, headers)` returns the event, or None for a webhook-id
    seen before (a resend after a lost answer is the same event). Keep the
    seen ids durable in production: here they are kept in memory.
    """

    def __init__(self, *secrets: str):
        if not secrets:
            raise ValueError("give at least one whsec_ secret")
        self._verifiers = [Webhook(s) for s in secrets]
        self._seen: set[str] = set()

    def receive(self, body: bytes, headers: dict) -> Optional[dict]:
        lowered = {k.lower(): v for k, v in headers.items()}
        event = None
        for verifier in self._verifiers:
            try:
                event = verifier.verify(body, lowered)
                break
            except WebhookVerificationError:
                continue
        if event is None:
            raise WebhookVerificationError("no secret verifies this webhook")
        webhook_id = lowered["webhook-id"]
        if webhook_id in self._seen:
            return None
        self._seen.add(webhook_id)
        return event


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def _backoff(attempt: int) -> float:
    return min(0.25 * (2**attempt), 8.0)


def _retry_after(response: httpx.Response, attempt: int) -> float:
    """The answer's Retry-After in seconds (at most 30), or a backoff."""
    try:
        seconds = float(response.headers["retry-after"])
    except (KeyError, ValueError):
        return _backoff(attempt)
    return _backoff(attempt) if seconds != seconds else min(max(seconds, 0.0), 30.0)


def _segment(text: str) -> str:
    from urllib.parse import quote

    return quote(text, safe="")


def _reason(reason: Optional[str]) -> Optional[dict]:
    return {"reason": reason} if reason else None


def _answer(response: httpx.Response) -> Any:
    if 200 <= response.status_code < 300:
        return response.json() if response.content else None
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        raise OnceflowError(response.status_code, "http_error", response.text[:200]) from None
    raise OnceflowError(response.status_code, error.get("code", ""), error.get("message", ""), error.get("field"))
