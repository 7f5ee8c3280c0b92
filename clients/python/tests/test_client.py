"""The Python client against a real `onceflow serve` (embedded PostgreSQL
in a throwaway folder), a fake OpenAI-style provider and a webhook
consumer on 127.0.0.1. Counts what the outside world saw: one webhook
processed per job, repeats dropped by webhook-id.

    ONCEFLOW_BIN=target/debug/onceflow python3 -m pytest clients/python
"""

import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

try:  # installed (`pip install clients/python`), as CI tests it in a fresh venv
    import onceflow_client  # noqa: F401
except ImportError:  # or this tree's source
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from onceflow_client import Client, ConnectionFailed, OnceflowError, Timeout, WebhookReceiver  # noqa: E402

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
BIN = os.environ.get("ONCEFLOW_BIN", os.path.join(os.path.dirname(__file__), "../../../target/debug/onceflow"))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(handler):
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


class Provider(BaseHTTPRequestHandler):
    requests = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        Provider.requests.append(self.headers.get("idempotency-key"))
        answer = json.dumps({
            "id": "chatcmpl-1", "object": "chat.completion", "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1},
        }).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


class Consumer(BaseHTTPRequestHandler):
    receiver = WebhookReceiver(SECRET)
    posts = []
    processed = []
    lock = threading.Lock()

    def do_POST(self):
        body = self.rfile.read(int(self.headers["content-length"]))
        with Consumer.lock:
            Consumer.posts.append(self.headers.get("webhook-id"))
            event = Consumer.receiver.receive(body, dict(self.headers))
            if event is not None:
                Consumer.processed.append(event)
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def node():
    provider, provider_url = serve(Provider)
    consumer, consumer_url = serve(Consumer)
    folder = tempfile.mkdtemp(prefix="onceflow-py-")
    os.chmod(folder, 0o755)  # the embedded server may run as `postgres`
    env = dict(os.environ, ONCEFLOW_DATA_DIR=os.path.join(folder, "data"))
    env.pop("DATABASE_URL", None)
    token = subprocess.run(
        [BIN, "token", "create", "--name", "py", "--admin"], env=env,
        capture_output=True, text=True, check=True,
    ).stdout.strip().splitlines()[-1]
    port = free_port()
    env.update(
        ONCEFLOW_LISTEN=f"127.0.0.1:{port}", OPENAI_BASE_URL=provider_url,
        ONCEFLOW_WEBHOOK_SECRET=SECRET, ONCEFLOW_ALLOW_PRIVATE_URLS="true",
        ONCEFLOW_POLL_MS="100",
    )
    log = open(os.path.join(folder, "serve.log"), "w")
    process = subprocess.Popen([BIN, "serve"], env=env, stdout=log, stderr=log)
    base = f"http://127.0.0.1:{port}"
    for _ in range(120):
        try:
            if httpx.get(f"{base}/healthz").status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    else:
        process.kill()
        raise RuntimeError(open(os.path.join(folder, "serve.log")).read())
    yield Client(base, token=token), consumer_url
    process.terminate()
    process.wait(timeout=30)
    provider.shutdown()
    consumer.shutdown()
    import shutil

    shutil.rmtree(folder, ignore_errors=True)


def completion(prompt):
    return {"model": "m", "messages": [{"role": "user", "content": prompt}]}


def test_submit_stream_and_one_verified_webhook(node):
    client, hook = node
    created = client.submit("py-1", "completion", completion("hi"), hook)
    assert created["state"] == "received"
    again = client.submit("py-1", "completion", completion("hi"), hook)
    assert again["id"] == "py-1" and again["incarnation"] == created["incarnation"]
    with pytest.raises(OnceflowError) as conflict:
        client.submit("py-1", "completion", completion("other"), hook)
    assert conflict.value.status == 409

    states = [e.data["text"] for e in client.events("py-1") if e.kind == "state"]
    assert states[-1] == "acked", states
    assert client.get("py-1")["state"] == "acked"
    # Resumed past the end of a finished job: the stream ends at once (204).
    last = max(e.id for e in client.events("py-1"))
    assert list(client.events("py-1", last_event_id=last)) == []

    deadline = time.time() + 10
    while time.time() < deadline and not any(e["data"]["job_id"] == "py-1" for e in Consumer.processed):
        time.sleep(0.1)
    mine = [e for e in Consumer.processed if e["data"]["job_id"] == "py-1"]
    assert len(mine) == 1, Consumer.processed
    assert Provider.requests.count("job:py-1:generate") == 1


def test_a_job_without_a_webhook_is_acked_and_posts_nothing(node):
    client, _hook = node
    created = client.submit("py-quiet", "completion", completion("hi"), concurrency_key="conv-1")
    assert created["state"] == "received"
    assert created["concurrency_key"] == "conv-1"
    states = [e.data["text"] for e in client.events("py-quiet") if e.kind == "state"]
    assert states[-1] == "acked", states
    assert client.get("py-quiet")["result"] is not None
    assert not any(e["data"]["job_id"] == "py-quiet" for e in Consumer.processed)
    assert Provider.requests.count("job:py-quiet:generate") == 1


def test_rerun_and_bulk_cancel(node):
    client, hook = node
    client.submit("py-orig", "completion", completion("again"), hook)
    states = [e.data["text"] for e in client.events("py-orig") if e.kind == "state"]
    assert states[-1] == "acked", states
    rerun = client.rerun("py-orig", "py-rerun")
    assert rerun["id"] == "py-rerun" and rerun["input"] == client.get("py-orig")["input"]
    assert client.rerun("py-orig", "py-rerun")["id"] == "py-rerun"  # the same rerun again
    for i in range(2):
        client.submit(f"py-bulk-{i}", "completion", completion("later"), hook, delay_ms=3_600_000)
    answers = client.submit_batch([
        {"id": "py-batch-1", "workflow": "completion", "input": completion("one")},
        {"id": "py-batch-2", "workflow": "nope", "input": completion("two")},
    ])
    assert [a["status"] for a in answers] == [201, 422], answers
    assert answers[1]["error"]["field"] == "workflow"
    states = [e.data["text"] for e in client.events("py-batch-1") if e.kind == "state"]
    assert states[-1] == "acked", states
    assert client.cancel_all("tidy", state="received", limit=1) == 1
    assert client.get("py-bulk-0")["state"] == "cancelled"
    assert client.get("py-bulk-1")["state"] == "received"
    with pytest.raises(OnceflowError) as bad:
        client.cancel_all(state="acked")
    assert bad.value.status == 422


def test_a_repeated_webhook_is_dropped_by_its_id():
    body = json.dumps({"type": "job.completed", "timestamp": "2026-12-03T00:00:00.000000Z", "data": {"job_id": "x"}}).encode()
    from standardwebhooks.webhooks import Webhook
    from datetime import datetime, timezone

    now = datetime.now(tz=timezone.utc)
    signature = Webhook(SECRET).sign("msg_1", now, body.decode())
    headers = {"webhook-id": "msg_1", "webhook-timestamp": str(int(now.timestamp())),
               "webhook-signature": signature}
    receiver = WebhookReceiver(SECRET)
    assert receiver.receive(body, headers)["data"]["job_id"] == "x"
    assert receiver.receive(body, headers) is None
    with pytest.raises(Exception):
        WebhookReceiver("whsec_" + "A" * 32).receive(body, headers)


def test_list_pages_cancel_redrive_and_errors(node):
    client, hook = node
    for i in range(5):
        client.submit(f"py-later-{i}", "completion", completion("later"), hook, delay_ms=3_600_000)
    later = [j["id"] for j in client.list(state="received", page_size=2) if j["id"].startswith("py-later-")]
    assert sorted(later) == [f"py-later-{i}" for i in range(5)]
    cancelled = client.cancel("py-later-0", reason="not needed")
    assert cancelled["state"] == "cancelled"
    with pytest.raises(OnceflowError) as not_dead:
        client.redrive("py-later-1")
    assert not_dead.value.status == 409
    with pytest.raises(OnceflowError) as bad:
        client.submit("py-bad", "completion", {"messages": []}, hook)
    assert bad.value.status == 422 and bad.value.field.startswith("input")
    with pytest.raises(OnceflowError) as missing:
        client.get("py-nobody")
    assert missing.value.status == 404


def test_signals_are_recorded_once_and_a_stale_decision_decides_nothing(node):
    client, hook = node
    client.submit("py-sig", "completion", completion("later"), hook, delay_ms=3_600_000)
    first = client.signal("py-sig", "go", "s-1", {"n": 1})
    assert first["id"] == "s-1" and first["taken_by"] is None
    assert client.signal("py-sig", "go", "s-1", {"n": 1})["id"] == "s-1"  # the same signal
    with pytest.raises(OnceflowError) as conflict:
        client.signal("py-sig", "go", "s-1", {"n": 2})
    assert (conflict.value.status, conflict.value.code) == (409, "signal_conflict")
    # For a wait the job is not in (it waits for nothing): refused, nothing kept.
    with pytest.raises(OnceflowError) as stale:
        client.signal("py-sig", "go", "s-2", {"n": 3}, until="2026-12-05T10:00:00.000000Z")
    assert (stale.value.status, stale.value.code) == (409, "not_waiting")
    waiting = [j["id"] for j in client.list(waiting=True) if j["id"] == "py-sig"]
    assert waiting == []
    assert [s["id"] for s in client.get("py-sig")["signals"]] == ["s-1"]


def test_a_read_is_retried_after_its_retry_after_capped_and_bounded_a_write_is_not(monkeypatch):
    import onceflow_client

    slept = []
    monkeypatch.setattr(onceflow_client, "_sleep", slept.append)
    answers = []
    # Retry-After of each busy answer, in turn; then the answer.
    waits = ["7", "120"]

    class Flaky(BaseHTTPRequestHandler):
        def answer(self, status, body, retry_after=None):
            data = json.dumps(body).encode()
            self.send_response(status)
            if retry_after is not None:
                self.send_header("retry-after", retry_after)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802
            answers.append("GET")
            n = len(answers)
            if n <= len(waits):
                self.answer(503, {"error": {"code": "busy", "message": "later"}}, waits[n - 1])
            else:
                self.answer(200, {"id": "j", "state": "acked"})

        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers.get("content-length") or 0))
            answers.append("POST")
            self.answer(503, {"error": {"code": "unavailable", "message": "partly done"}}, "0")

        def log_message(self, *args):
            pass

    server, url = serve(Flaky)
    try:
        assert Client(url).get("j")["state"] == "acked"
        assert answers == ["GET"] * 3, "two 503s, then the answer"
        assert slept == [7.0, 30.0], "each Retry-After honoured, capped at 30 s"
        answers.clear()
        slept.clear()
        with pytest.raises(OnceflowError) as refused:
            Client(url, max_retries=1).get("j")
        assert refused.value.status == 503 and answers == ["GET"] * 2, "one retry, then the error"
        answers.clear()
        with pytest.raises(OnceflowError) as unavailable:
            Client(url).cancel_all("tidy", state="received")
        assert unavailable.value.status == 503 and answers == ["POST"], "a write's 503 is not retried"
    finally:
        server.shutdown()


def test_wait_returns_the_final_job(node):
    client, hook = node
    client.submit("py-wait", "completion", completion("hi"), hook)
    job = client.wait("py-wait", timeout=30)
    assert job["state"] == "acked" and job["result"] is not None
    with pytest.raises(TimeoutError):
        client.submit("py-later", "completion", completion("later"), hook, delay_ms=3_600_000)
        client.wait("py-later", timeout=0.3)


def test_answers_are_typed_models_and_errors_the_class_of_their_status(node):
    from onceflow_client import Conflict, Invalid, Job, JobSummary, NotFound, Signal

    client, hook = node
    job = client.submit("py-typed", "completion", completion("typed"), hook, tags={"team": "py"})
    assert isinstance(job, Job) and job.id == "py-typed" and job.state == "received"
    assert job.tags == {"team": "py"} and job["state"] == job.state  # also the dict sent
    done = client.wait("py-typed", timeout=30)
    assert done.finished and done.state == "acked" and done.result is not None
    assert [h.state for h in done.history][-1] == "acked"
    assert done.history[0].attempt == 0
    listed = [j for j in client.list(tag="team:py")]
    assert [j.id for j in listed] == ["py-typed"] and isinstance(listed[0], JobSummary)
    assert listed[0].token == "py"  # the admin token that submitted it
    later = client.submit("py-typed-later", "completion", completion("x"), hook, delay_ms=3_600_000)
    sent = client.signal(later.id, "go", "sig-1", {"ok": True})
    assert isinstance(sent, Signal) and sent.id == "sig-1" and sent.taken_by is None
    assert client.get(later.id).signals[0].payload == {"ok": True}
    with pytest.raises(Conflict) as conflict:
        client.submit("py-typed", "completion", completion("other"), hook)
    assert conflict.value.code == "conflict" and isinstance(conflict.value, OnceflowError)
    with pytest.raises(Invalid) as invalid:
        client.submit("py-typed-bad", "completion", {"model": "m"}, hook)
    assert invalid.value.status == 422 and invalid.value.field.startswith("input")
    with pytest.raises(NotFound):
        client.get("py-typed-nobody")
    stats = client.stats()
    assert stats.states["acked"] >= 1, stats


def test_schedules_are_created_shown_paused_and_deleted(node):
    from onceflow_client import NotFound, Schedule

    client, hook = node
    made = client.create_schedule(
        "py-nightly", "0 2 * * *", "completion", completion("nightly"), hook, timezone="Europe/Paris"
    )
    assert isinstance(made, Schedule) and made.cron == "0 2 * * *" and made.next_fire_at
    assert made.timezone == "Europe/Paris" and not made.paused
    assert [s.id for s in client.schedules() if s.id == "py-nightly"] == ["py-nightly"]
    shown = client.get_schedule("py-nightly")
    assert shown.latest_jobs == []
    paused = client.pause_schedule("py-nightly")
    assert paused.paused and paused.next_fire_at is None
    assert not client.resume_schedule("py-nightly").paused
    client.delete_schedule("py-nightly")
    with pytest.raises(NotFound):
        client.get_schedule("py-nightly")


def test_the_async_client_submits_follows_waits_lists_signals_and_cancels(node):
    import asyncio

    from onceflow_client import AsyncClient, Conflict, Job

    sync, hook = node
    base = str(sync._http.base_url)
    token = sync._http.headers["authorization"].split(" ", 1)[1]

    async def scenario():
        async with AsyncClient(base, token=token) as client:
            job = await client.submit("py-async", "completion", completion("async"), hook)
            assert isinstance(job, Job) and job.state == "received"
            states = [e.data["text"] async for e in client.events("py-async") if e.kind == "state"]
            assert states[-1] == "acked", states
            done = await client.wait("py-async", timeout=30)
            assert done.state == "acked" and done.result is not None
            ids = [j.id async for j in client.list(state="acked", page_size=2)]
            assert "py-async" in ids
            later = await client.submit("py-async-later", "completion", completion("x"), hook, delay_ms=3_600_000)
            assert (await client.signal(later.id, "go", "a-1", 1)).id == "a-1"
            made = await client.create_schedule("py-async-nightly", "0 3 * * *", "completion", completion("n"))
            assert [x.id async for x in client.schedules(page_size=1) if x.id == made.id] == [made.id]
            await client.delete_schedule(made.id)
            cancelled = await client.cancel(later.id, reason="not needed")
            assert cancelled.state == "cancelled"
            try:
                await client.redrive(later.id)
            except Conflict as e:
                return e.code
            return None

    assert asyncio.run(scenario()) == "not_dead"
    assert Provider.requests.count("job:py-async:generate") == 1
    mine = [e for e in Consumer.processed if e["data"]["job_id"] == "py-async"]
    deadline = time.time() + 10
    while time.time() < deadline and not mine:
        time.sleep(0.1)
        mine = [e for e in Consumer.processed if e["data"]["job_id"] == "py-async"]
    assert len(mine) == 1


class Faulty(BaseHTTPRequestHandler):
    """A proxy before the node that loses the answer after the node did the
    work: for each POST path, in turn, a 503, a 502, a reset connection and
    an answer later than the client's timeout; then the node's own answer."""

    target = None
    plan = ["503", "502", "reset", "slow"]
    seen = {}
    lock = threading.Lock()

    def forward(self, method):
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length) if length else None
        headers = {k: v for k, v in self.headers.items() if k.lower() in ("authorization", "content-type")}
        answer = httpx.request(method, Faulty.target + self.path, content=body, headers=headers, timeout=30)
        with Faulty.lock:
            n = Faulty.seen.get((method, self.path), 0)
            Faulty.seen[(method, self.path)] = n + 1
        fault = Faulty.plan[n] if method == "POST" and n < len(Faulty.plan) else None
        if fault == "reset":
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
            self.close_connection = True
            return
        if fault == "slow":
            time.sleep(2.5)
        status, data = answer.status_code, answer.content
        if fault in ("503", "502"):
            status, data = int(fault), b'{"error": {"code": "unavailable", "message": "lost"}}'
        try:
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            pass  # the client gave up (a slow answer)

    def do_POST(self):  # noqa: N802
        self.forward("POST")

    def do_GET(self):  # noqa: N802
        self.forward("GET")

    def log_message(self, *args):
        pass


def test_a_submit_a_signal_and_a_cancel_ride_through_lost_answers_and_are_done_once(node, monkeypatch):
    """Every write is idempotent by its id, so the client sends it again on a
    503, a 502, a reset connection and a timeout: each reached the node five
    times, and the node made one job, recorded one signal and one cancel."""
    import onceflow_client

    slept = []
    monkeypatch.setattr(onceflow_client, "_sleep", slept.append)
    client, _ = node
    Faulty.target = str(client._http.base_url).rstrip("/")
    Faulty.seen = {}
    proxy, proxy_url = serve(Faulty)
    try:
        flaky = Client(proxy_url, token=client._http.headers["authorization"].split(" ", 1)[1],
                       timeout=1.0, max_retries=4)
        job = flaky.submit("py-flaky", "completion", completion("x"), delay_ms=600_000)
        assert job.id == "py-flaky" and job.state == "received"
        signal = flaky.signal("py-flaky", "nudge", "n-1", {"n": 1})
        assert signal["id"] == "n-1"
        cancelled = flaky.cancel("py-flaky", "tidy")
        assert cancelled.state == "cancelled"
        for path in ["/v1/jobs", "/v1/jobs/py-flaky/signals/nudge", "/v1/jobs/py-flaky/cancel"]:
            assert Faulty.seen[("POST", path)] == 5, f"every fault fired before the answer: {path}"
        seen = client.get("py-flaky")
        assert [s["id"] for s in seen.signals] == ["n-1"], "one signal recorded"
        assert [h["state"] for h in seen["history"]].count("cancelled") == 1, "one cancel recorded"
        assert Provider.requests.count("job:py-flaky:generate") == 0, "a delayed job was never run"
        assert len(slept) == 12 and all(0 <= s <= 8 for s in slept), slept
        fixed = {0.25 * 2**n for n in range(4)}
        assert any(s not in fixed for s in slept), f"full jitter, not the fixed backoff: {slept}"
    finally:
        proxy.shutdown()


def test_no_answer_is_the_clients_own_error_with_its_cause():
    """A connection refused and an answer that never comes outlast the
    retries as ConnectionFailed and Timeout, the httpx error kept as cause."""
    import asyncio

    from onceflow_client import AsyncClient

    port = free_port()
    with pytest.raises(ConnectionFailed) as refused:
        Client(f"http://127.0.0.1:{port}", max_retries=1).get("j")
    assert isinstance(refused.value.__cause__, httpx.ConnectError)
    assert refused.value.status == 0 and refused.value.code == "connection"

    asked = []

    class Silent(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            asked.append(self.path)
            time.sleep(1.5)

        def log_message(self, *args):
            pass

    server, url = serve(Silent)
    try:
        with pytest.raises(Timeout) as late:
            Client(url, timeout=0.3, max_retries=1).get("j")
        assert isinstance(late.value.__cause__, httpx.TimeoutException)
        assert isinstance(late.value, ConnectionFailed) and late.value.code == "timeout"
        assert len(asked) == 2, "sent again once after the timeout"

        async def run():
            async with AsyncClient(url, timeout=0.3, max_retries=2) as aclient:
                await aclient.get("j")

        asked.clear()
        with pytest.raises(Timeout):
            asyncio.run(run())
        assert len(asked) == 3, "the async client too: sent again twice"
    finally:
        server.shutdown()


def test_a_fastapi_consumer_verifies_a_real_delivery_and_drops_its_repeat(node):
    """A consumer as a team writes one in FastAPI: the raw body and
    Starlette's headers to WebhookReceiver, a repeat dropped by webhook-id."""
    import uvicorn
    from standardwebhooks.webhooks import WebhookVerificationError

    from onceflow_client import WebhookInProgress
    from fastapi import FastAPI, Request, Response
    from standardwebhooks.webhooks import Webhook as Signer

    client, _ = node
    receiver = WebhookReceiver(SECRET)
    processed, requests = [], []
    app = FastAPI()

    @app.post("/hooks")
    async def hook(request: Request):
        requests.append(request.headers.get("webhook-id"))

        async def store(event):
            processed.append(event["data"]["job_id"])
            return "stored"

        try:
            done = await receiver.ahandle(await request.body(), request.headers, store)
        except WebhookVerificationError:
            return Response(status_code=401)
        except WebhookInProgress:
            return Response(status_code=409)
        # None: a resend of a webhook-id already handled.
        return Response(status_code=204 if done == "stored" else 200)

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        for _ in range(100):
            if server.started:
                break
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port}/hooks"
        client.submit("py-fastapi", "completion", completion("fastapi"), url)
        for _ in range(150):
            if processed:
                break
            time.sleep(0.1)
        assert processed == ["py-fastapi"], requests
        assert client.wait("py-fastapi", timeout=30)["delivery"]["status"] == "delivered"
        # The same delivery again (a resend after a lost answer): answered, not processed.
        import datetime

        at = datetime.datetime.now(datetime.timezone.utc)
        body = json.dumps({"type": "job.completed", "timestamp": at.isoformat(), "data": {"job_id": "py-fastapi"}})
        signature = Signer(SECRET).sign("job:py-fastapi:completed", at, body)
        headers = {
            "content-type": "application/json", "webhook-id": "job:py-fastapi:completed",
            "webhook-timestamp": str(int(at.timestamp())), "webhook-signature": signature,
        }
        assert httpx.post(url, content=body, headers=headers).status_code == 200
        assert httpx.post(url, content=body, headers={"webhook-id": "x"}).status_code == 401
        assert processed == ["py-fastapi"], "processed once"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_the_states_are_the_documents(node):
    """``JobState`` (a ``Literal``) names exactly the document's enum, in order."""
    from onceflow_client import STATES

    client, _ = node
    doc = client._http.get("/v1/openapi.json").json()
    assert list(STATES) == doc["components"]["schemas"]["JobState"]["enum"]


def test_the_typed_results_are_the_documents(node):
    """``CompletionResult`` and ``AgentResult`` name exactly the fields of
    the document's ``Result_completion`` and ``Result_agent``, and a
    finished completion's result reads through ``result_as``."""
    from onceflow_client import AgentResult, CompletionResult

    client, hook = node
    doc = client._http.get("/v1/openapi.json").json()
    for kind, component in [(CompletionResult, "Result_completion"), (AgentResult, "Result_agent")]:
        schema = doc["components"]["schemas"][component]
        assert set(kind.__annotations__) == set(schema["properties"]), (kind, schema)
        assert kind.__required_keys__ == set(schema["required"]), (kind, schema)
    client.submit("py-result-typed", "completion", completion("typed"), hook)
    job = client.wait("py-result-typed", timeout=30)
    result = job.result_as(CompletionResult, "completion")
    assert result is not None and result["content"] and result["model"], job.result
    assert set(result) == set(CompletionResult.__annotations__), result
    assert job.result_as(AgentResult, "agent") is None, "another workflow's result"


def test_a_keep_alive_between_events_is_no_event():
    """The node sends a keep-alive comment every 15 s; httpx-sse reports one
    as an event with an empty body once an event had an id. It is skipped."""
    import asyncio

    from onceflow_client import AsyncClient

    class Stream(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = (
                'id: 1\nevent: state\ndata: {"text": "received"}\n\n'
                ": keep-alive\n\n"
                'id: 2\nevent: state\ndata: {"text": "acked"}\n\n'
            ).encode()
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server, url = serve(Stream)
    try:
        assert [e.data["text"] for e in Client(url).events("j")] == ["received", "acked"]

        async def run():
            async with AsyncClient(url) as aclient:
                return [e.data["text"] async for e in aclient.events("j")]

        assert asyncio.run(run()) == ["received", "acked"]
    finally:
        server.shutdown()


def test_an_event_stream_answered_503_is_asked_again_from_the_same_event(monkeypatch):
    """A stream refused while the node restarts (503 with Retry-After, then
    a 502 from a proxy) is opened again with the same Last-Event-ID; every
    event comes once."""
    import asyncio

    import onceflow_client
    from onceflow_client import AsyncClient

    slept = []
    monkeypatch.setattr(onceflow_client.time, "sleep", slept.append)

    async def no_sleep(s):
        slept.append(s)

    monkeypatch.setattr(onceflow_client.asyncio, "sleep", no_sleep)

    class Restarting(BaseHTTPRequestHandler):
        asked = []

        def do_GET(self):  # noqa: N802
            Restarting.asked.append(self.headers.get("last-event-id"))
            n = len(Restarting.asked)
            if n % 3 == 1:
                body = b'id: 4\nevent: state\ndata: {"text": "generated"}\n\n'
                status = 200
            elif n % 3 == 2:
                body, status = b'{"error": {"code": "unavailable", "message": "draining"}}', 503
            else:
                body, status = b"bad gateway", 502
            if status == 200 and self.headers.get("last-event-id") == "4":
                body = b'id: 5\nevent: state\ndata: {"text": "acked"}\n\n'
            self.send_response(status)
            self.send_header("content-type", "text/event-stream" if status == 200 else "application/json")
            self.send_header("retry-after", "1")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server, url = serve(Restarting)
    try:
        # 1: "generated" then the stream ends; 2: 503; 3: 502; 4: "acked".
        assert [e.data["text"] for e in Client(url).events("j", last_event_id=3)] == ["generated", "acked"]
        assert Restarting.asked == ["3", "4", "4", "4"], Restarting.asked
        # A backoff after the early end, then the refusals' Retry-After: 1.
        assert slept[1:] == [1.0, 1.0], slept
        Restarting.asked, slept[:] = [], []

        async def run():
            async with AsyncClient(url) as aclient:
                return [e.data["text"] async for e in aclient.events("j", last_event_id=3)]

        assert asyncio.run(run()) == ["generated", "acked"]
        assert Restarting.asked == ["3", "4", "4", "4"], Restarting.asked
        assert slept[1:] == [1.0, 1.0], slept
        # Past its reconnects, the refusal is the API's error.
        Restarting.asked = []
        with pytest.raises(onceflow_client.Unavailable):
            list(Client(url).events("j", last_event_id=3, reconnects=1))
    finally:
        server.shutdown()
    # No node at all: past its reconnects, the client's own error, its cause kept.
    with pytest.raises(onceflow_client.ConnectionFailed) as refused:
        list(Client("http://127.0.0.1:9").events("j", reconnects=2))
    assert isinstance(refused.value.__cause__, httpx.TransportError), refused.value.__cause__


def test_a_handler_that_fails_leaves_its_webhook_to_be_handled_again():
    """`handle` marks a webhook-id done only after the handler returned: the
    resend after a failed handling runs it again; after a success, a resend
    is answered without running it; a resend during the handling is refused."""
    from datetime import datetime, timezone

    from standardwebhooks.webhooks import Webhook

    from onceflow_client import WebhookInProgress

    body = json.dumps({"type": "job.completed", "timestamp": "2026-12-07T00:00:00.000000Z",
                       "data": {"job_id": "h"}}).encode()
    now = datetime.now(tz=timezone.utc)
    headers = {"webhook-id": "msg_h", "webhook-timestamp": str(int(now.timestamp())),
               "webhook-signature": Webhook(SECRET).sign("msg_h", now, body.decode())}
    receiver = WebhookReceiver(SECRET)
    runs = []

    def failing(event):
        runs.append(event["data"]["job_id"])
        raise RuntimeError("the database is down")

    with pytest.raises(RuntimeError):
        receiver.handle(body, headers, failing)

    def nested(event):
        runs.append("nested")
        with pytest.raises(WebhookInProgress):
            receiver.handle(body, headers, lambda e: runs.append("never"))
        return "stored"

    async def coroutine(event):
        runs.append("awaited")

    with pytest.raises(TypeError):
        receiver.handle(body, headers, coroutine)  # ahandle is for these
    assert receiver.handle(body, headers, nested) == "stored"
    assert receiver.handle(body, headers, lambda e: runs.append("never")) is None
    assert runs == ["h", "nested"], runs
    # No webhook-id: unverified (a 401), not a KeyError (a 500).
    from standardwebhooks.webhooks import WebhookVerificationError

    with pytest.raises(WebhookVerificationError):
        receiver.handle(body, {k: v for k, v in headers.items() if k != "webhook-id"}, failing)
