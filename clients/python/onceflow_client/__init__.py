"""A typed client for onceflow's HTTP API (see GET /v1/openapi.json).

    from onceflow_client import Client
    client = Client("http://127.0.0.1:8080", token=os.environ["ONCEFLOW_TOKEN"])
    client.submit("order-42", "completion", {"model": "gpt-4o-mini", "messages": msgs}, hook_url)
    for event in client.events("order-42"):
        print(event.kind, event.data)
    print(client.wait("order-42", timeout=60).result)

``AsyncClient`` has the same calls, awaited (``async for`` for ``list``
and ``events``). Answers are typed models (``Job``, ``JobSummary``,
``Schedule``, ``Stats``, ``Signal``; each also the ``dict`` the server
sent). Errors are ``OnceflowError`` with the API's status, code, message
and the field at fault, raised as the subclass of their status
(``Invalid`` for 422, ``Conflict`` for 409, ``NotFound``, ``RateLimited``,
``Unavailable``, ``ServerError``, ``Unauthorized``, ``BadRequest``); no
answer at all is ``ConnectionFailed`` (``Timeout`` for a timeout).

Retried, at most ``max_retries`` times, with full-jitter backoff (a random
pause up to 0.25 s × 2^attempt, at most 8 s) or after the answer's
Retry-After (at most 30 s): every call on 429, 500, 502, 503 and 504, a
connection refused, reset or closed mid-answer, and a timeout. That is
safe because every write of the API is idempotent by its id: a submit sent
again is the same job (the stored one), a signal the same signal, a cancel
the same cancel, a re-run the same new job, a schedule the same schedule,
a schedule's delete sent again after it was done is taken as done. Three
calls are sent again only where the server did no work (429, or a
connection never opened): ``cancel_all`` and ``redrive_all`` (keyed by no
id), and ``redrive`` (a redrive done twice could redrive a job that died
again meanwhile). A transport failure that outlasts the
retries raises ``ConnectionFailed`` (``Timeout`` for a timeout), with the
``httpx`` error as its cause. An event stream reconnects from its
last event on a dropped connection and on 429/5xx (after Retry-After), at
most ``reconnects`` times in a row. Webhooks are verified with the Standard
Webhooks reference library and handled once per webhook-id, the id marked
only after the handler returned (WebhookReceiver.handle).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Dict, Iterator, List, Mapping, Optional, Union
from urllib.parse import quote

import httpx
import httpx_sse
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from .models import (
    STATES,
    AgentResult,
    CompletionResult,
    TERMINAL,
    JobState,
    BatchAnswer,
    Child,
    Event,
    HistoryEntry,
    Job,
    JobSummary,
    Schedule,
    ScheduledJob,
    Signal,
    Stats,
)

__all__ = [
    "AgentResult",
    "CompletionResult",
    "AsyncClient",
    "BadRequest",
    "BatchAnswer",
    "Child",
    "Client",
    "Conflict",
    "ConnectionFailed",
    "Event",
    "HistoryEntry",
    "Invalid",
    "Job",
    "JobState",
    "JobSummary",
    "NotFound",
    "OnceflowError",
    "RateLimited",
    "Schedule",
    "ScheduledJob",
    "ServerError",
    "STATES",
    "Signal",
    "Stats",
    "Timeout",
    "Unauthorized",
    "Unavailable",
    "WebhookInProgress",
    "WebhookReceiver",
    "WebhookVerificationError",
]


class OnceflowError(Exception):
    """An answer other than 2xx: ``{"error": {"code", "message", "field"?}}``."""

    def __init__(self, status: int, code: str, message: str, field: Optional[str] = None):
        super().__init__(f"{status} {code}: {message}" + (f" (field {field})" if field else ""))
        self.status = status
        self.code = code
        self.message = message
        self.field = field


class ConnectionFailed(OnceflowError):
    """No answer: the connection could not be opened, was reset or closed
    before the answer, after every retry (``status`` 0; the ``httpx`` error
    is the ``__cause__``)."""

    def __init__(self, message: str, code: str = "connection"):
        super().__init__(0, code, message)


class Timeout(ConnectionFailed):
    """No answer within the client's ``timeout``, after every retry."""

    def __init__(self, message: str):
        super().__init__(message, "timeout")


class BadRequest(OnceflowError):
    """400: the request could not be read (malformed JSON, a bad header)."""


class Unauthorized(OnceflowError):
    """401: the token is missing, unknown or revoked."""


class NotFound(OnceflowError):
    """404: no such job or schedule (or another token's)."""


class Conflict(OnceflowError):
    """409: the id holds another request, or the job is not in the state the call needs."""


class Invalid(OnceflowError):
    """422: ``field`` is invalid."""


class RateLimited(OnceflowError):
    """429: the backlog or the streams are full; retried by the client first."""


class Unavailable(OnceflowError):
    """503: the node is draining or its database is down; retried first."""


class ServerError(OnceflowError):
    """500, 502, 504 (or another 5xx): the server or a proxy before it
    failed; retried first."""


_BY_STATUS = {
    400: BadRequest,
    401: Unauthorized,
    404: NotFound,
    409: Conflict,
    422: Invalid,
    429: RateLimited,
    500: ServerError,
    502: ServerError,
    503: Unavailable,
    504: ServerError,
}


@dataclass
class _Req:
    """One call of the API: what to send, and how to type the answer."""

    method: str
    path: str
    params: Optional[Dict[str, str]] = None
    body: Any = None
    wrap: Callable[[Any], Any] = field(default=lambda answer: answer)
    # Keyed by an id (every write but a redrive and the bulk ones): safe
    # to send again.
    idempotent: bool = True
    # A delete: `404` after an earlier send got no answer means it was done.
    gone_ok: bool = False

    def kwargs(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        if self.params:
            out["params"] = self.params
        if self.body is not None:
            out["json"] = self.body
        return out


def _segment(text: str) -> str:
    return quote(text, safe="")


def _reason(reason: Optional[str]) -> Optional[dict]:
    return {"reason": reason} if reason else None


def _with(body: dict, **optional: Any) -> dict:
    for key, value in optional.items():
        if value is not None:
            body[key] = value
    return body


class _Calls:
    """The requests of every call, shared by ``Client`` and ``AsyncClient``."""

    @staticmethod
    def submit(id, workflow, input, webhook_url, priority, run_at, delay_ms, tags, concurrency_key) -> _Req:
        body = _with(
            {"id": id, "workflow": workflow, "input": input},
            webhook_url=webhook_url,  # none: the job POSTs nothing
            tags=tags or None,
            priority=priority,
            run_at=run_at,
            delay_ms=delay_ms,
            concurrency_key=concurrency_key,
        )
        return _Req("POST", "/v1/jobs", body=body, wrap=Job)

    @staticmethod
    def get(id: str) -> _Req:
        return _Req("GET", f"/v1/jobs/{_segment(id)}", wrap=Job)

    @staticmethod
    def list_params(state, workflow, waiting, tag, page_size) -> Dict[str, str]:
        params = {"limit": str(page_size)}
        if state:
            params["state"] = state
        if workflow:
            params["workflow"] = workflow
        if tag:
            params["tag"] = tag
        if isinstance(waiting, str):
            params["waiting"] = waiting
        elif waiting is not None:
            params["waiting"] = "true" if waiting else "false"
        return params

    @staticmethod
    def cancel(id: str, reason: Optional[str]) -> _Req:
        return _Req("POST", f"/v1/jobs/{_segment(id)}/cancel", body=_reason(reason), wrap=Job)

    @staticmethod
    def submit_batch(jobs: list) -> _Req:
        return _Req(
            "POST", "/v1/jobs/batch", body={"jobs": jobs},
            wrap=lambda a: [BatchAnswer(x) for x in a["jobs"]],
        )

    @staticmethod
    def cancel_all(reason, state, workflow, tag, limit) -> _Req:
        body = _with(_reason(reason) or {}, state=state, workflow=workflow, tag=tag, limit=limit)
        return _Req(
            "POST", "/v1/jobs/cancel", body=body, wrap=lambda a: a["cancelled"], idempotent=False
        )

    @staticmethod
    def rerun(id: str, new_id: str) -> _Req:
        return _Req("POST", f"/v1/jobs/{_segment(id)}/rerun", body={"id": new_id}, wrap=Job)

    @staticmethod
    def redrive(id: str, reason: Optional[str], confirm_unknown: bool) -> _Req:
        params = {"confirm_unknown": "true"} if confirm_unknown else None
        return _Req(
            "POST", f"/v1/jobs/{_segment(id)}/redrive", params=params,
            body=_reason(reason), wrap=Job, idempotent=False,
        )

    @staticmethod
    def redrive_all(reason, workflow, limit, confirm_unknown) -> _Req:
        params = {"confirm_unknown": "true"} if confirm_unknown else None
        body = _with(_reason(reason) or {}, workflow=workflow, limit=limit)
        return _Req("POST", "/v1/jobs/redrive", params=params, body=body, idempotent=False)

    @staticmethod
    def signal(id, name, signal_id, payload, until) -> _Req:
        body = _with({"id": signal_id, "payload": payload}, until=until)
        return _Req(
            "POST", f"/v1/jobs/{_segment(id)}/signals/{_segment(name)}", body=body, wrap=Signal
        )

    @staticmethod
    def stats() -> _Req:
        return _Req("GET", "/v1/stats", wrap=Stats)

    @staticmethod
    def create_schedule(id, cron, workflow, input, webhook_url, timezone, catch_up) -> _Req:
        body = _with(
            {"id": id, "cron": cron, "workflow": workflow, "input": input},
            webhook_url=webhook_url,
            timezone=timezone,
            catch_up=catch_up,
        )
        return _Req("POST", "/v1/schedules", body=body, wrap=Schedule)

    @staticmethod
    def get_schedule(id: str) -> _Req:
        return _Req("GET", f"/v1/schedules/{_segment(id)}", wrap=Schedule)

    @staticmethod
    def set_paused(id: str, paused: bool) -> _Req:
        action = "pause" if paused else "resume"
        return _Req("POST", f"/v1/schedules/{_segment(id)}/{action}", wrap=Schedule)

    @staticmethod
    def delete_schedule(id: str) -> _Req:
        return _Req("DELETE", f"/v1/schedules/{_segment(id)}", wrap=lambda _: None, gone_ok=True)


#: Answers a call is sent again after: busy, or the server or a proxy failed.
RETRIED_STATUSES = (429, 500, 502, 503, 504)


def _retry(req: "_Req", attempt: int, max_retries: int, outcome: Union[httpx.Response, Exception]) -> Optional[float]:
    """How long to wait before sending ``req`` again, or ``None`` to stop here."""
    if attempt >= max_retries:
        return None
    if isinstance(outcome, Exception):
        # A bulk call is sent again only when it never left.
        again = (httpx.TransportError,) if req.idempotent else (httpx.ConnectError, httpx.ConnectTimeout)
        return _backoff(attempt) if isinstance(outcome, again) else None
    again = RETRIED_STATUSES if req.idempotent else (429,)
    return _retry_after(outcome, attempt) if outcome.status_code in again else None


def _failed(e: httpx.TransportError, req: "_Req") -> ConnectionFailed:
    """The client's own error for a transport failure (its cause kept)."""
    what = f"{req.method} {req.path}"
    if isinstance(e, httpx.TimeoutException):
        return Timeout(f"{what}: no answer in time ({type(e).__name__})")
    return ConnectionFailed(f"{what}: {type(e).__name__}: {e}")


def _event(sse: Any) -> Event:
    return Event(int(sse.id), sse.event, json.loads(sse.data))


def _is_last(event: Event) -> bool:
    return event.kind == "state" and event.data.get("text") in TERMINAL


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

    def _call(self, req: _Req) -> Any:
        attempt = 0
        while True:
            try:
                response = self._http.request(req.method, req.path, **req.kwargs())
            except httpx.TransportError as e:
                pause = _retry(req, attempt, self.max_retries, e)
                if pause is None:
                    raise _failed(e, req) from e
            else:
                if attempt > 0 and req.gone_ok and response.status_code == 404:
                    return req.wrap(None)  # done by a send whose answer was lost
                pause = _retry(req, attempt, self.max_retries, response)
                if pause is None:
                    return req.wrap(_answer(response))
            _sleep(pause)
            attempt += 1

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
        tags: Optional[Dict[str, str]] = None,
        concurrency_key: Optional[str] = None,
    ) -> Job:
        """Submits a job; the same job again returns the stored one (200).

        ``concurrency_key``: at most the token's (or workflow's) limit of
        this token's jobs with the same key run at once (1 by default)."""
        return self._call(_Calls.submit(
            id, workflow, input, webhook_url, priority, run_at, delay_ms, tags, concurrency_key
        ))

    def get(self, id: str) -> Job:
        return self._call(_Calls.get(id))

    def wait(self, id: str, timeout: Optional[float] = None) -> Job:
        """Waits for the job to reach a final state (acked, dead or
        cancelled) and returns it; TimeoutError after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.05
        while True:
            job = self.get(id)
            if job.finished:
                return job
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"job {id} is still {job.state} after {timeout} s")
            time.sleep(pause if left is None else min(pause, left))
            pause = min(pause * 2, 1.0)

    def list(
        self,
        *,
        state: Optional[str] = None,
        workflow: Optional[str] = None,
        waiting: Union[bool, str, None] = None,
        tag: Optional[str] = None,
        page_size: int = 50,
    ) -> Iterator[JobSummary]:
        """Every matching job, newest first, page after page (keyset cursor).

        ``waiting``: ``True`` for the jobs that wait, ``False`` for the others,
        or a kind (``"sleep"``, ``"signal"``, ``"approval"``, ``"children"``,
        ``"budget"``, ``"concurrency"``, ``"throttle"``). ``tag``: ``label:value``."""
        params = _Calls.list_params(state, workflow, waiting, tag, page_size)
        while True:
            page = self._call(_Req("GET", "/v1/jobs", params=dict(params)))
            yield from (JobSummary(j) for j in page["jobs"])
            if not page.get("next_cursor"):
                return
            params["cursor"] = page["next_cursor"]

    def cancel(self, id: str, reason: Optional[str] = None) -> Job:
        return self._call(_Calls.cancel(id, reason))

    def submit_batch(self, jobs: List[dict]) -> List[BatchAnswer]:
        """Submits up to 1,000 jobs (each a ``POST /v1/jobs`` body) in one request.

        Returns one answer per job, in order: ``status`` and ``job``, or
        ``status`` and ``error``, as a single submit would have answered it.
        """
        return self._call(_Calls.submit_batch(jobs))

    def cancel_all(
        self,
        reason: Optional[str] = None,
        *,
        state: Optional[str] = None,
        workflow: Optional[str] = None,
        tag: Optional[str] = None,
        limit: Optional[int] = None,
    ) -> int:
        """Cancels the caller's live jobs, oldest first, by filter; returns how many."""
        return self._call(_Calls.cancel_all(reason, state, workflow, tag, limit))

    def rerun(self, id: str, new_id: str) -> Job:
        """Runs job ``id``'s workflow again on its input as job ``new_id`` (idempotent by it)."""
        return self._call(_Calls.rerun(id, new_id))

    def redrive(self, id: str, reason: Optional[str] = None, confirm_unknown: bool = False) -> Job:
        return self._call(_Calls.redrive(id, reason, confirm_unknown))

    def redrive_all(
        self,
        reason: Optional[str] = None,
        *,
        workflow: Optional[str] = None,
        limit: Optional[int] = None,
        confirm_unknown: bool = False,
    ) -> dict:
        """Redrives the caller's dead jobs: ``{"redriven", "skipped_unknown"}``."""
        return self._call(_Calls.redrive_all(reason, workflow, limit, confirm_unknown))

    def signal(self, id: str, name: str, signal_id: str, payload: Any, until: Optional[str] = None) -> Signal:
        """Sends job ``id`` the signal ``name``, recorded once under ``signal_id``.

        With ``until`` (a wait's ``waiting["until"]``), it is recorded only
        while the job waits for ``name`` with that due time (else
        ``Conflict`` ``not_waiting``), and only once (``wait_decided``).
        """
        return self._call(_Calls.signal(id, name, signal_id, payload, until))

    def stats(self) -> Stats:
        """Jobs per state, and each budget's spend today."""
        return self._call(_Calls.stats())

    def create_schedule(
        self,
        id: str,
        cron: str,
        workflow: str,
        input: dict,
        webhook_url: Optional[str] = None,
        *,
        timezone: Optional[str] = None,
        catch_up: Optional[str] = None,
    ) -> Schedule:
        """Creates a schedule: one job ``{id}:{fire time}`` per fire time of ``cron``."""
        return self._call(_Calls.create_schedule(id, cron, workflow, input, webhook_url, timezone, catch_up))

    def get_schedule(self, id: str) -> Schedule:
        """The schedule, with its latest ten jobs (``latest_jobs``), newest first."""
        return self._call(_Calls.get_schedule(id))

    def schedules(self, page_size: int = 100) -> Iterator[Schedule]:
        """Every schedule of the caller, by id, page after page."""
        params = {"limit": str(page_size)}
        while True:
            page = self._call(_Req("GET", "/v1/schedules", params=dict(params)))
            yield from (Schedule(s) for s in page["schedules"])
            if not page.get("next_cursor"):
                return
            params["cursor"] = page["next_cursor"]

    def pause_schedule(self, id: str) -> Schedule:
        return self._call(_Calls.set_paused(id, True))

    def resume_schedule(self, id: str) -> Schedule:
        return self._call(_Calls.set_paused(id, False))

    def delete_schedule(self, id: str) -> None:
        self._call(_Calls.delete_schedule(id))

    def events(self, id: str, last_event_id: Optional[int] = None, reconnects: int = 5) -> Iterator[Event]:
        """The job's events as they are journaled, from after ``last_event_id``.

        A dropped connection is resumed with ``Last-Event-ID``, so nothing is
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
                    status = source.response.status_code
                    if status in RETRIED_STATUSES and failures < reconnects:
                        # Busy or failing (a restart, a proxy): asked again
                        # after its Retry-After, from the same event.
                        source.response.read()
                        failures += 1
                        time.sleep(_retry_after(source.response, failures - 1))
                        continue
                    if status != 200:
                        source.response.read()
                        _answer(source.response)
                    for sse in source.iter_sse():
                        if not sse.data:
                            # A keep-alive comment: httpx-sse reports one as an
                            # event (with the last id) once any event had an id.
                            # The stream is healthy: a later drop starts afresh.
                            failures = 0
                            continue
                        event = _event(sse)
                        last, failures = event.id, 0
                        yield event
                        if _is_last(event):
                            return
                # Ended before the final state (a restart, a proxy's
                # timeout): resumed after `last`; a finished job says 204.
                failures += 1
                if failures > reconnects:
                    raise ConnectionFailed(f"GET /v1/jobs/{_segment(id)}/events: the stream kept ending early")
            except httpx.TransportError as e:
                failures += 1
                if failures > reconnects:
                    raise _failed(e, _Req("GET", f"/v1/jobs/{_segment(id)}/events")) from e
            time.sleep(_backoff(failures - 1))


class AsyncClient:
    """``Client``'s calls for asyncio, over ``httpx.AsyncClient``."""

    def __init__(
        self,
        base_url: str,
        token: Optional[str] = None,
        timeout: float = 30.0,
        max_retries: int = 3,
    ):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout)
        self.max_retries = max_retries

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def _call(self, req: _Req) -> Any:
        attempt = 0
        while True:
            try:
                response = await self._http.request(req.method, req.path, **req.kwargs())
            except httpx.TransportError as e:
                pause = _retry(req, attempt, self.max_retries, e)
                if pause is None:
                    raise _failed(e, req) from e
            else:
                if attempt > 0 and req.gone_ok and response.status_code == 404:
                    return req.wrap(None)  # done by a send whose answer was lost
                pause = _retry(req, attempt, self.max_retries, response)
                if pause is None:
                    return req.wrap(_answer(response))
            await _asleep(pause)
            attempt += 1

    async def submit(
        self,
        id: str,
        workflow: str,
        input: dict,
        webhook_url: Optional[str] = None,
        *,
        priority: Optional[int] = None,
        run_at: Optional[str] = None,
        delay_ms: Optional[int] = None,
        tags: Optional[Dict[str, str]] = None,
        concurrency_key: Optional[str] = None,
    ) -> Job:
        """See ``Client.submit``."""
        return await self._call(_Calls.submit(
            id, workflow, input, webhook_url, priority, run_at, delay_ms, tags, concurrency_key
        ))

    async def get(self, id: str) -> Job:
        return await self._call(_Calls.get(id))

    async def wait(self, id: str, timeout: Optional[float] = None) -> Job:
        """See ``Client.wait``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.05
        while True:
            job = await self.get(id)
            if job.finished:
                return job
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"job {id} is still {job.state} after {timeout} s")
            await asyncio.sleep(pause if left is None else min(pause, left))
            pause = min(pause * 2, 1.0)

    async def list(
        self,
        *,
        state: Optional[str] = None,
        workflow: Optional[str] = None,
        waiting: Union[bool, str, None] = None,
        tag: Optional[str] = None,
        page_size: int = 50,
    ) -> AsyncIterator[JobSummary]:
        """See ``Client.list``."""
        params = _Calls.list_params(state, workflow, waiting, tag, page_size)
        while True:
            page = await self._call(_Req("GET", "/v1/jobs", params=dict(params)))
            for j in page["jobs"]:
                yield JobSummary(j)
            if not page.get("next_cursor"):
                return
            params["cursor"] = page["next_cursor"]

    async def cancel(self, id: str, reason: Optional[str] = None) -> Job:
        return await self._call(_Calls.cancel(id, reason))

    async def submit_batch(self, jobs: List[dict]) -> List[BatchAnswer]:
        return await self._call(_Calls.submit_batch(jobs))

    async def cancel_all(
        self,
        reason: Optional[str] = None,
        *,
        state: Optional[str] = None,
        workflow: Optional[str] = None,
        tag: Optional[str] = None,
        limit: Optional[int] = None,
    ) -> int:
        return await self._call(_Calls.cancel_all(reason, state, workflow, tag, limit))

    async def rerun(self, id: str, new_id: str) -> Job:
        return await self._call(_Calls.rerun(id, new_id))

    async def redrive(self, id: str, reason: Optional[str] = None, confirm_unknown: bool = False) -> Job:
        return await self._call(_Calls.redrive(id, reason, confirm_unknown))

    async def redrive_all(
        self,
        reason: Optional[str] = None,
        *,
        workflow: Optional[str] = None,
        limit: Optional[int] = None,
        confirm_unknown: bool = False,
    ) -> dict:
        return await self._call(_Calls.redrive_all(reason, workflow, limit, confirm_unknown))

    async def signal(self, id: str, name: str, signal_id: str, payload: Any, until: Optional[str] = None) -> Signal:
        """See ``Client.signal``."""
        return await self._call(_Calls.signal(id, name, signal_id, payload, until))

    async def stats(self) -> Stats:
        return await self._call(_Calls.stats())

    async def create_schedule(
        self,
        id: str,
        cron: str,
        workflow: str,
        input: dict,
        webhook_url: Optional[str] = None,
        *,
        timezone: Optional[str] = None,
        catch_up: Optional[str] = None,
    ) -> Schedule:
        return await self._call(_Calls.create_schedule(id, cron, workflow, input, webhook_url, timezone, catch_up))

    async def get_schedule(self, id: str) -> Schedule:
        return await self._call(_Calls.get_schedule(id))

    async def schedules(self, page_size: int = 100) -> AsyncIterator[Schedule]:
        """See ``Client.schedules``."""
        params = {"limit": str(page_size)}
        while True:
            page = await self._call(_Req("GET", "/v1/schedules", params=dict(params)))
            for s in page["schedules"]:
                yield Schedule(s)
            if not page.get("next_cursor"):
                return
            params["cursor"] = page["next_cursor"]

    async def pause_schedule(self, id: str) -> Schedule:
        return await self._call(_Calls.set_paused(id, True))

    async def resume_schedule(self, id: str) -> Schedule:
        return await self._call(_Calls.set_paused(id, False))

    async def delete_schedule(self, id: str) -> None:
        await self._call(_Calls.delete_schedule(id))

    async def events(self, id: str, last_event_id: Optional[int] = None, reconnects: int = 5) -> AsyncIterator[Event]:
        """See ``Client.events``."""
        last = last_event_id
        failures = 0
        while True:
            headers = {"Last-Event-ID": str(last)} if last is not None else {}
            try:
                async with httpx_sse.aconnect_sse(
                    self._http, "GET", f"/v1/jobs/{_segment(id)}/events", headers=headers,
                    timeout=httpx.Timeout(self._http.timeout.connect, read=None),
                ) as source:
                    if source.response.status_code == 204:
                        return
                    status = source.response.status_code
                    if status in RETRIED_STATUSES and failures < reconnects:
                        # Busy or failing (a restart, a proxy): asked again
                        # after its Retry-After, from the same event.
                        await source.response.aread()
                        failures += 1
                        await asyncio.sleep(_retry_after(source.response, failures - 1))
                        continue
                    if status != 200:
                        await source.response.aread()
                        _answer(source.response)
                    async for sse in source.aiter_sse():
                        if not sse.data:
                            # A keep-alive comment: httpx-sse reports one as an
                            # event (with the last id) once any event had an id.
                            # The stream is healthy: a later drop starts afresh.
                            failures = 0
                            continue
                        event = _event(sse)
                        last, failures = event.id, 0
                        yield event
                        if _is_last(event):
                            return
                failures += 1
                if failures > reconnects:
                    raise ConnectionFailed(f"GET /v1/jobs/{_segment(id)}/events: the stream kept ending early")
            except httpx.TransportError as e:
                failures += 1
                if failures > reconnects:
                    raise _failed(e, _Req("GET", f"/v1/jobs/{_segment(id)}/events")) from e
            await asyncio.sleep(_backoff(failures - 1))


class WebhookInProgress(Exception):
    """The same webhook-id is being handled right now (a resend arrived while
    the first delivery's handler runs): answer 409 and let it come again."""


class WebhookReceiver:
    """Verifies onceflow's webhooks (Standard Webhooks) and drops repeats.

    ``handle(body, headers, handler)`` verifies the webhook, runs
    ``handler(event)`` once per webhook-id, and marks the id done only when
    the handler returned: a handler that raised leaves it unmarked, so the
    resend that follows your error answer is handled again. It returns the
    handler's result, or None for an id already handled (answer 2xx: the
    resend after a lost answer is the same event); the same id arriving
    while its handler still runs raises ``WebhookInProgress``.
    ``receive(body, headers)`` verifies and marks at once (for handling that
    cannot fail). ``body`` is the raw bytes as received; ``headers`` any
    mapping of names to values, whatever their case: FastAPI's and
    Starlette's ``request.headers``, Flask's, ``http.server``'s
    ``self.headers``, a ``dict``. Keep the handled ids durable in
    production (with your handler's own write): here they are kept in
    memory.
    """

    def __init__(self, *secrets: str):
        if not secrets:
            raise ValueError("give at least one whsec_ secret")
        self._verifiers = [Webhook(s) for s in secrets]
        self._seen: set[str] = set()
        self._running: set[str] = set()
        # Handlers run on threads (Flask, http.server): a check and its mark
        # are one step.
        self._lock = threading.Lock()

    def verify(self, body: bytes, headers: Mapping[str, str]) -> tuple[str, dict]:
        """The webhook-id and the event, or ``WebhookVerificationError``."""
        lowered = {k.lower(): v for k, v in headers.items()}
        for verifier in self._verifiers:
            try:
                event = verifier.verify(body, lowered)
            except WebhookVerificationError:
                continue
            # Verified: the signed id is there (the library checks it).
            return lowered["webhook-id"], event
        raise WebhookVerificationError("no secret verifies this webhook")

    def receive(self, body: bytes, headers: Mapping[str, str]) -> Optional[dict]:
        """The event, or None for a webhook-id seen before; marks it at once."""
        webhook_id, event = self.verify(body, headers)
        with self._lock:
            if webhook_id in self._seen:
                return None
            self._seen.add(webhook_id)
        return event

    def handle(self, body: bytes, headers: Mapping[str, str], handler: Callable[[dict], Any]) -> Any:
        """Runs ``handler(event)`` once per webhook-id; marks it after success."""
        webhook_id, event = self._claim(body, headers)
        if webhook_id is None:
            return None
        done = False
        try:
            result = handler(event)
            if inspect.isawaitable(result):
                getattr(result, "close", lambda: None)()
                raise TypeError("handle() takes a plain function; use ahandle() for an async handler")
            done = True
            return result
        finally:
            self._settle(webhook_id, done)

    async def ahandle(self, body: bytes, headers: Mapping[str, str], handler: Callable[[dict], Any]) -> Any:
        """``handle`` with an ``async`` handler."""
        webhook_id, event = self._claim(body, headers)
        if webhook_id is None:
            return None
        done = False
        try:
            result = await handler(event)
            done = True
            return result
        finally:
            self._settle(webhook_id, done)

    def _claim(self, body: bytes, headers: Mapping[str, str]) -> tuple[Optional[str], dict]:
        """Verifies; ``(None, event)`` for an id already handled; marks it running."""
        webhook_id, event = self.verify(body, headers)
        with self._lock:
            if webhook_id in self._seen:
                return None, event
            if webhook_id in self._running:
                raise WebhookInProgress(webhook_id)
            self._running.add(webhook_id)
        return webhook_id, event

    def _settle(self, webhook_id: str, done: bool) -> None:
        with self._lock:
            if done:
                self._seen.add(webhook_id)
            self._running.discard(webhook_id)


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


async def _asleep(seconds: float) -> None:
    await asyncio.sleep(seconds)


def _backoff(attempt: int) -> float:
    """Full jitter: a random pause up to the attempt's exponential bound, so
    clients refused together do not come back together."""
    return random.uniform(0.0, min(0.25 * (2**attempt), 8.0))


def _retry_after(response: httpx.Response, attempt: int) -> float:
    """The answer's Retry-After in seconds (at most 30), or a backoff."""
    try:
        seconds = float(response.headers["retry-after"])
    except (KeyError, ValueError):
        return _backoff(attempt)
    return _backoff(attempt) if seconds != seconds else min(max(seconds, 0.0), 30.0)


def _answer(response: httpx.Response) -> Any:
    if 200 <= response.status_code < 300:
        return response.json() if response.content else None
    kind = _BY_STATUS.get(response.status_code, OnceflowError)
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        raise kind(response.status_code, "http_error", response.text[:200]) from None
    raise kind(response.status_code, error.get("code", ""), error.get("message", ""), error.get("field"))
