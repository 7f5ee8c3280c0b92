"""Typed views of the API's JSON objects.

Each model is the object the server sent (a ``dict``, so ``job["state"]``
and ``json.dumps(job)`` keep working) with typed, read-only attributes for
its documented fields: ``job.state``, ``job.signals[0].taken_by``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Generic, List, Literal, Optional, Tuple, TypedDict, TypeVar, get_args, overload

T = TypeVar("T")

__all__ = [
    "AgentResult",
    "BatchAnswer",
    "CompletionResult",
    "Child",
    "Event",
    "HistoryEntry",
    "Job",
    "JobSummary",
    "Schedule",
    "ScheduledJob",
    "Signal",
    "Stats",
    "JobState",
    "STATES",
    "TERMINAL",
]

#: A job's state, as the document's ``JobState`` enum names them.
JobState = Literal[
    "received", "generated", "persisted", "claimed", "delivered", "acked", "dead", "cancelled"
]

#: Every state, in the lifecycle's order.
STATES: Tuple[JobState, ...] = get_args(JobState)

#: The states a job ends in.
TERMINAL = frozenset({"acked", "dead", "cancelled"})


class _Field(Generic[T]):
    """A typed attribute read from the object's key (``None`` when absent)."""

    def __init__(self, key: str, convert: Optional[Callable[[Any], T]] = None):
        self.key = key
        self.convert = convert

    @overload
    def __get__(self, obj: None, owner: type) -> "_Field[T]": ...

    @overload
    def __get__(self, obj: "_Record", owner: type) -> T: ...

    def __get__(self, obj: Optional["_Record"], owner: type) -> Any:
        if obj is None:
            return self
        value = obj.get(self.key)
        if value is None or self.convert is None:
            return value
        return self.convert(value)


class _Record(Dict[str, Any]):
    """A JSON object of the API: a ``dict`` with typed attributes."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({dict.__repr__(self)})"


def _list_of(model: Callable[[Any], T]) -> Callable[[Any], List[T]]:
    return lambda items: [model(item) for item in items]


class HistoryEntry(_Record):
    """One transition: the state reached, when, on which attempt and node."""

    state: _Field[JobState] = _Field("state")
    at: _Field[str] = _Field("at")
    attempt: _Field[int] = _Field("attempt")
    worker: _Field[str] = _Field("worker")


class Signal(_Record):
    """A signal sent to a job, and the wait that took it (``None``: kept)."""

    name: _Field[str] = _Field("name")
    id: _Field[str] = _Field("id")
    payload: _Field[Any] = _Field("payload")
    received_at: _Field[str] = _Field("received_at")
    taken_by: _Field[Optional[str]] = _Field("taken_by")


class Child(_Record):
    """A child job as its parent's view lists it."""

    id: _Field[str] = _Field("id")
    workflow: _Field[str] = _Field("workflow")
    state: _Field[JobState] = _Field("state")


class JobSummary(_Record):
    """A job as ``GET /v1/jobs`` lists it."""

    id: _Field[str] = _Field("id")
    workflow: _Field[str] = _Field("workflow")
    state: _Field[JobState] = _Field("state")
    attempts: _Field[int] = _Field("attempts")
    incarnation: _Field[int] = _Field("incarnation")
    created_at: _Field[str] = _Field("created_at")
    updated_at: _Field[str] = _Field("updated_at")
    finished_at: _Field[Optional[str]] = _Field("finished_at")
    dead_reason: _Field[Optional[str]] = _Field("dead_reason")
    #: What it waits for (``{"kind", ...}``), or ``None``.
    waiting: _Field[Optional[Dict[str, Any]]] = _Field("waiting")
    tags: _Field[Dict[str, str]] = _Field("tags")
    #: The name of the token that submitted it (its tenant), or ``None``.
    token: _Field[Optional[str]] = _Field("token")

    @property
    def finished(self) -> bool:
        """Whether the job is in a final state (acked, dead, cancelled)."""
        return self.state in TERMINAL


class CompletionResult(TypedDict):
    """The ``result`` of a finished ``completion`` job (the document's
    ``Result_completion``): ``job.result_as(CompletionResult)``."""

    content: str
    model: str
    finish_reason: Optional[str]
    usage: Optional[Dict[str, Any]]


class AgentResult(TypedDict):
    """The ``result`` of a finished ``agent`` job (``Result_agent``)."""

    content: str
    turns: int
    tool_calls: int


R = TypeVar("R")


class Job(JobSummary):
    """A job as ``GET /v1/jobs/{id}`` shows it."""

    def result_as(self, kind: "type[R]", workflow: Optional[str] = None) -> Optional[R]:
        """The ``result``, typed as ``kind`` (``CompletionResult``,
        ``AgentResult``, or a ``TypedDict`` of your own workflow's
        ``Result_{workflow}``); ``None`` while the job has none, or when
        ``workflow`` is given and the job is another workflow's."""
        if workflow is not None and self.get("workflow") != workflow:
            return None
        return self.get("result")

    input: _Field[Dict[str, Any]] = _Field("input")
    webhook_url: _Field[Optional[str]] = _Field("webhook_url")
    result: _Field[Any] = _Field("result")
    priority: _Field[int] = _Field("priority")
    concurrency_key: _Field[Optional[str]] = _Field("concurrency_key")
    #: The last error (``{"code", "message", ...}``), or ``None``.
    last_error: _Field[Optional[Dict[str, Any]]] = _Field("last_error")
    delivery: _Field[Optional[Dict[str, Any]]] = _Field("delivery")
    trace_id: _Field[Optional[str]] = _Field("trace_id")
    parent: _Field[Optional[str]] = _Field("parent")
    history: _Field[List[HistoryEntry]] = _Field("history", _list_of(HistoryEntry))
    signals: _Field[List[Signal]] = _Field("signals", _list_of(Signal))
    children: _Field[List[Child]] = _Field("children", _list_of(Child))


class ScheduledJob(_Record):
    """A job a schedule made (``state`` ``None`` once purged, or skipped)."""

    id: _Field[str] = _Field("id")
    fire_at: _Field[str] = _Field("fire_at")
    state: _Field[Optional[JobState]] = _Field("state")
    skipped: _Field[Optional[str]] = _Field("skipped")


class Schedule(_Record):
    """A schedule: a cron that creates jobs, once per fire time."""

    id: _Field[str] = _Field("id")
    cron: _Field[str] = _Field("cron")
    timezone: _Field[str] = _Field("timezone")
    workflow: _Field[str] = _Field("workflow")
    input: _Field[Dict[str, Any]] = _Field("input")
    webhook_url: _Field[Optional[str]] = _Field("webhook_url")
    catch_up: _Field[str] = _Field("catch_up")
    paused: _Field[bool] = _Field("paused")
    next_fire_at: _Field[Optional[str]] = _Field("next_fire_at")
    created_at: _Field[str] = _Field("created_at")
    #: Its latest ten jobs, newest first (``get_schedule`` only).
    latest_jobs: _Field[Optional[List[ScheduledJob]]] = _Field(
        "latest_jobs", _list_of(ScheduledJob)
    )


class Stats(_Record):
    """Jobs per state, and each budget's spend today (``GET /v1/stats``)."""

    states: _Field[Dict[str, int]] = _Field("states")
    budgets: _Field[List[Dict[str, Any]]] = _Field("budgets")


class BatchAnswer(_Record):
    """One job of a batch: ``status`` and ``job``, or ``status`` and ``error``."""

    status: _Field[int] = _Field("status")
    job: _Field[Optional[Job]] = _Field("job", Job)
    error: _Field[Optional[Dict[str, Any]]] = _Field("error")


@dataclass(frozen=True)
class Event:
    """One event of a job's stream: ``state``, ``chunk`` or ``reset``."""

    id: int
    kind: str
    data: dict
