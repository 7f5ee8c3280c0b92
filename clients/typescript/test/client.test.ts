// The TypeScript client against a real `onceflow serve` (embedded
// PostgreSQL in a throwaway folder), a fake OpenAI-style provider and a
// webhook consumer on 127.0.0.1, under node's own test runner. Counts what
// the outside world saw: model requests per job, webhooks verified.
//
//   ONCEFLOW_BIN=target/debug/onceflow npm test   (in clients/typescript)
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { spawn, execFileSync, type ChildProcess } from "node:child_process";
import { createServer, type Server } from "node:http";
import { mkdtempSync, chmodSync, openSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";

import express from "express";
import { Hono } from "hono";
import { serve as serveHono } from "@hono/node-server";
import type { AddressInfo } from "node:net";

import {
  Onceflow,
  OnceflowConnectionError,
  OnceflowError,
  OnceflowTimeoutError,
  resultOf,
  verifyWebhook,
} from "../src/index.js";

const SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const BIN = resolve(process.env.ONCEFLOW_BIN ?? "../../target/debug/onceflow");

const modelRequests: string[] = [];
const webhooks: { id: string; event: ReturnType<typeof verifyWebhook> }[] = [];
let servers: Server[] = [];
let serve: ChildProcess;
let client: Onceflow;
let hook: string;
let folder: string;
let base: string;
let token: string;

function listen(handler: (body: string, headers: Record<string, string>) => [number, string]): Promise<string> {
  const server = createServer((req, res) => {
    let body = "";
    req.on("data", (c) => (body += c));
    req.on("end", () => {
      const [status, answer] = handler(body, req.headers as Record<string, string>);
      res.writeHead(status, { "content-type": "application/json" }).end(answer);
    });
  });
  servers.push(server);
  return new Promise((ok) =>
    server.listen(0, "127.0.0.1", () => {
      const address = server.address();
      ok(`http://127.0.0.1:${typeof address === "object" && address ? address.port : 0}`);
    }),
  );
}

function freePort(): Promise<number> {
  const probe = createServer();
  return new Promise((ok) =>
    probe.listen(0, "127.0.0.1", () => {
      const address = probe.address();
      const port = typeof address === "object" && address ? address.port : 0;
      probe.close(() => ok(port));
    }),
  );
}

const completion = (prompt: string) => ({ model: "m", messages: [{ role: "user" as const, content: prompt }] });

before(async () => {
  const provider = await listen((body, headers) => {
    modelRequests.push(headers["idempotency-key"] ?? "");
    const request = JSON.parse(body);
    return [
      200,
      JSON.stringify({
        id: "chatcmpl-1",
        object: "chat.completion",
        model: request.model,
        choices: [{ index: 0, message: { role: "assistant", content: "hello" }, finish_reason: "stop" }],
        usage: { prompt_tokens: 3, completion_tokens: 1 },
      }),
    ];
  });
  hook = await listen((body, headers) => {
    webhooks.push({ id: headers["webhook-id"], event: verifyWebhook(SECRET, body, headers) });
    return [204, ""];
  });
  folder = mkdtempSync(join(tmpdir(), "onceflow-ts-"));
  chmodSync(folder, 0o755); // the embedded server may run as `postgres`
  const env: NodeJS.ProcessEnv = { ...process.env, ONCEFLOW_DATA_DIR: join(folder, "data") };
  delete env.DATABASE_URL;
  token = execFileSync(BIN, ["token", "create", "--name", "ts", "--admin"], {
    env,
    encoding: "utf8",
    stdio: ["ignore", "pipe", "ignore"],
  })
    .trim()
    .split("\n")
    .pop()!;
  const port = await freePort();
  const log = openSync(join(folder, "serve.log"), "w");
  serve = spawn(BIN, ["serve"], {
    env: {
      ...env,
      ONCEFLOW_LISTEN: `127.0.0.1:${port}`,
      OPENAI_BASE_URL: provider,
      ONCEFLOW_WEBHOOK_SECRET: SECRET,
      ONCEFLOW_ALLOW_PRIVATE_URLS: "true",
      ONCEFLOW_POLL_MS: "100",
    },
    stdio: ["ignore", log, log],
  });
  base = `http://127.0.0.1:${port}`;
  for (let i = 0; i < 240; i++) {
    try {
      if ((await fetch(`${base}/healthz`)).ok) break;
    } catch {
      // not listening yet
    }
    await new Promise((ok) => setTimeout(ok, 500));
  }
  assert.ok((await fetch(`${base}/healthz`)).ok, "onceflow serve is up");
  client = new Onceflow({ baseUrl: base, token });
});

after(async () => {
  if (serve && serve.exitCode === null && serve.signalCode === null) {
    const exited = new Promise((ok) => serve.once("exit", ok));
    serve.kill("SIGTERM");
    await exited;
  }
  for (const s of servers) s.close();
  servers = [];
  if (folder) rmSync(folder, { recursive: true, force: true });
});

test("a job is submitted once, followed to its end, and its webhook verified", async () => {
  const first = await client.submit({ id: "ts-1", workflow: "completion", input: completion("hi"), webhook_url: hook });
  assert.equal(first.created, true);
  const again = await client.submit({ id: "ts-1", workflow: "completion", input: completion("hi"), webhook_url: hook });
  assert.equal(again.created, false, "the same job again is the stored one");
  const states: string[] = [];
  for await (const event of client.events("ts-1")) {
    if (event.kind === "state") states.push(String(event.data.text));
  }
  assert.equal(states.at(-1), "acked", `states ${states}`);
  const job = await client.wait("ts-1", { timeoutMs: 30_000 });
  assert.equal(job.state, "acked");
  // The result, typed by its workflow (Result_completion in the document).
  const result = resultOf(job, "completion");
  assert.ok(result !== undefined && typeof result.content === "string" && result.model.length > 0, JSON.stringify(job.result));
  assert.equal(resultOf(job, "agent"), undefined, "another workflow's job has no agent result");
  assert.equal(modelRequests.filter((k) => k === "job:ts-1:generate").length, 1, "one model request");
  for (let i = 0; i < 100 && !webhooks.some((w) => w.event.data.job_id === "ts-1"); i++) {
    await new Promise((ok) => setTimeout(ok, 100));
  }
  const mine = webhooks.filter((w) => w.event.data.job_id === "ts-1");
  assert.equal(mine.length, 1, "one webhook, verified with the node's secret");
  assert.equal(mine[0].id, "job:ts-1:completed");
  assert.equal(mine[0].event.type, "job.completed");
  assert.throws(() => verifyWebhook("whsec_" + Buffer.from("x".repeat(32)).toString("base64"), "{}", {
    "webhook-id": "a", "webhook-timestamp": String(Math.floor(Date.now() / 1000)), "webhook-signature": "v1,bad",
  }));
});

test("a waiting job is listed, signalled and cancelled; a bad request is a typed error", async () => {
  await client.submit({ id: "ts-later", workflow: "completion", input: completion("later"), delay_ms: 3_600_000 });
  const page = await client.list({ limit: 10 });
  assert.ok(page.jobs.some((j) => j.id === "ts-later"), "the list has it");
  await client.signal("ts-later", "go", { id: "s-1", payload: { ok: true } });
  const signalled = await client.get("ts-later");
  assert.deepEqual(signalled.signals.map((s) => s.id), ["s-1"]);
  const cancelled = await client.cancel("ts-later", "not needed");
  assert.equal(cancelled.state, "cancelled");
  await assert.rejects(client.wait("ts-never", { timeoutMs: 100 }), (e: unknown) => {
    assert.ok(e instanceof OnceflowError);
    assert.equal(e.status, 404);
    return true;
  });
  await assert.rejects(
    client.submit({ id: "ts-bad", workflow: "completion", input: { model: "m", messages: [] } }),
    (e: unknown) => e instanceof OnceflowError && e.status === 422 && e.field !== undefined,
  );
  assert.equal(modelRequests.filter((k) => k.startsWith("job:ts-later")).length, 0, "no model request");
  // A workflow of the user's own is a plain name and any input, judged by
  // the node: this one (examples/greet's binary) runs "greet", and no "nope".
  await assert.rejects(
    client.submit({ id: "ts-nope", workflow: "nope", input: {} }),
    (e: unknown) => e instanceof OnceflowError && e.status === 422 && e.field === "workflow",
  );
  const own = await client.submit({ id: "ts-own", workflow: "greet", input: { name: "Ada" } });
  assert.equal(own.created, true);
  const greeted = await client.wait("ts-own", { timeoutMs: 30_000 });
  assert.equal(greeted.state, "acked");
  assert.equal(resultOf<{ greeting: string }>(greeted, "greet")?.greeting, "hello", JSON.stringify(greeted.result));
  assert.equal(modelRequests.filter((k) => k === "job:ts-own:greet").length, 1, "its one model call");
});

test("a 503 is retried for a read and a write alike, within the bound", async () => {
  let seen = 0;
  const flaky = await listen(() => {
    seen += 1;
    return seen <= 2 ? [503, JSON.stringify({ error: { code: "busy", message: "later" } })] : [200, JSON.stringify({ id: "j", state: "acked" })];
  });
  const patient = new Onceflow({ baseUrl: flaky });
  assert.equal((await patient.get("j")).state, "acked");
  assert.equal(seen, 3, "two 503s, then the answer");
  seen = 0;
  const hasty = new Onceflow({ baseUrl: flaky, maxRetries: 1 });
  await assert.rejects(hasty.get("j"), (e: unknown) => e instanceof OnceflowError && e.status === 503);
  assert.equal(seen, 2, "one retry, then the error");
  seen = 0;
  assert.equal((await patient.cancel("j", "tidy")).state, "acked");
  assert.equal(seen, 3, "a cancel is idempotent: sent again after each 503");
  for (const bulk of [() => patient.cancelAll({ reason: "tidy" }), () => patient.redriveAll(), () => patient.redrive("j")]) {
    seen = 0;
    await assert.rejects(bulk(), (e: unknown) => e instanceof OnceflowError && e.status === 503);
    assert.equal(seen, 1, "keyed by no id (or a redrive): a 503 is not sent again");
  }
});

test("an event stream answered 503, then 502, is asked again from the same event", async () => {
  const asked: (string | undefined)[] = [];
  const server = createServer((req, res) => {
    const last = req.headers["last-event-id"] as string | undefined;
    asked.push(last);
    const n = asked.length;
    if (n === 2 || n === 3) {
      res.writeHead(n === 2 ? 503 : 502, { "content-type": "application/json", "retry-after": "0" });
      res.end(JSON.stringify({ error: { code: "unavailable", message: "draining" } }));
      return;
    }
    res.writeHead(200, { "content-type": "text/event-stream" });
    res.end(last === "4" ? 'id: 5\nevent: state\ndata: {"text":"acked"}\n\n' : 'id: 4\nevent: state\ndata: {"text":"generated"}\n\n');
  });
  servers.push(server);
  const url: string = await new Promise((ok) =>
    server.listen(0, "127.0.0.1", () => {
      const address = server.address();
      ok(`http://127.0.0.1:${typeof address === "object" && address ? address.port : 0}`);
    }),
  );
  const seen: string[] = [];
  for await (const event of new Onceflow({ baseUrl: url }).events("j", { lastEventId: 3 })) {
    seen.push(String(event.data.text));
  }
  assert.deepEqual(seen, ["generated", "acked"]);
  assert.deepEqual(asked, ["3", "4", "4", "4"], "resumed after event 4 through a 503 and a 502");
  asked.length = 0;
  asked.push("x"); // the next request is the 2nd: 503, then 502 past one retry
  await assert.rejects(
    (async () => {
      for await (const _ of new Onceflow({ baseUrl: url, maxRetries: 1 }).events("j")) void _;
    })(),
    (e: unknown) => e instanceof OnceflowError && e.status === 502,
  );
});

test("a request past its timeout is sent again, then rejects with the client's own timeout", async () => {
  let seen = 0;
  const silent = createServer(() => {
    seen += 1; // never answers
  });
  servers.push(silent);
  const url: string = await new Promise((ok) =>
    silent.listen(0, "127.0.0.1", () => {
      const address = silent.address();
      ok(`http://127.0.0.1:${typeof address === "object" && address ? address.port : 0}`);
    }),
  );
  const impatient = new Onceflow({ baseUrl: url, timeoutMs: 200, maxRetries: 1 });
  for (const call of [() => impatient.get("j"), () => impatient.cancel("j")]) {
    seen = 0;
    await assert.rejects(call(), (e: unknown) => {
      assert.ok(e instanceof OnceflowTimeoutError && e instanceof OnceflowConnectionError, String(e));
      assert.equal((e.cause as Error).name, "TimeoutError");
      assert.equal(e.status, 0);
      return true;
    });
    assert.equal(seen, 2, "one retry after the timeout");
  }
  silent.closeAllConnections();
  const refused = new Onceflow({ baseUrl: "http://127.0.0.1:9", maxRetries: 1 });
  await assert.rejects(refused.get("j"), (e: unknown) => e instanceof OnceflowConnectionError && !(e instanceof OnceflowTimeoutError) && e.cause !== undefined);
});

/**
 * A proxy before the node that loses the answer after the node did the
 * work: for each POST, in turn, a 503, a 502, a reset connection and an
 * answer later than the client's timeout; then the node's own answer.
 */
async function faultyProxy(target: string): Promise<{ url: string; seen: Map<string, number> }> {
  const seen = new Map<string, number>();
  const plan = ["503", "502", "reset", "slow"];
  const server = createServer((req, res) => {
    const chunks: Buffer[] = [];
    req.on("data", (c: Buffer) => chunks.push(c));
    req.on("end", async () => {
      const body = Buffer.concat(chunks);
      const headers: Record<string, string> = {};
      for (const name of ["authorization", "content-type"]) {
        const value = req.headers[name];
        if (typeof value === "string") headers[name] = value;
      }
      const answer = await fetch(target + req.url, { method: req.method, headers, body: body.length ? body : undefined });
      const data = Buffer.from(await answer.arrayBuffer());
      const key = `${req.method} ${req.url}`;
      const n = seen.get(key) ?? 0;
      seen.set(key, n + 1);
      const fault = req.method === "POST" ? plan[n] : undefined;
      if (fault === "reset") {
        req.socket.resetAndDestroy();
        return;
      }
      if (fault === "slow") await new Promise((ok) => setTimeout(ok, 1500));
      const lost = fault === "503" || fault === "502";
      try {
        res
          .writeHead(lost ? Number(fault) : answer.status, { "content-type": "application/json" })
          .end(lost ? JSON.stringify({ error: { code: "unavailable", message: "lost" } }) : data);
      } catch {
        // the client gave up on a slow answer
      }
    });
  });
  servers.push(server);
  const url: string = await new Promise((ok) =>
    server.listen(0, "127.0.0.1", () => {
      const address = server.address();
      ok(`http://127.0.0.1:${typeof address === "object" && address ? address.port : 0}`);
    }),
  );
  return { url, seen };
}

test("a submit, a signal and a cancel ride through lost answers and are done once", async () => {
  const proxy = await faultyProxy(base);
  const flaky = new Onceflow({ baseUrl: proxy.url, token, timeoutMs: 700, maxRetries: 4 });
  const submitted = await flaky.submit({ id: "ts-flaky", workflow: "completion", input: completion("x"), delay_ms: 600_000 });
  assert.equal(submitted.job.id, "ts-flaky");
  assert.equal(submitted.created, false, "created by the first send, found by the fifth");
  const signal = await flaky.signal("ts-flaky", "nudge", { id: "n-1", payload: { n: 1 } });
  assert.equal(signal.id, "n-1");
  assert.equal((await flaky.cancel("ts-flaky", "tidy")).state, "cancelled");
  for (const path of ["/v1/jobs", "/v1/jobs/ts-flaky/signals/nudge", "/v1/jobs/ts-flaky/cancel"]) {
    assert.equal(proxy.seen.get(`POST ${path}`), 5, `every fault fired before the answer: ${path}`);
  }
  const job = await client.get("ts-flaky");
  assert.deepEqual(job.signals.map((s) => s.id), ["n-1"], "one signal recorded");
  assert.equal(job.history.filter((h) => h.state === "received").length, 1, "one job made");
  assert.equal(job.history.filter((h) => h.state === "cancelled").length, 1, "one cancel recorded");
  assert.equal(modelRequests.filter((k) => k.startsWith("job:ts-flaky")).length, 0, "a delayed job never ran");
});

test("webhooks verify with the headers each framework hands over", async () => {
  const secret = "whsec_" + Buffer.from("k".repeat(32)).toString("base64");
  const { Webhook } = await import("standardwebhooks");
  const body = JSON.stringify({ type: "job.completed", timestamp: new Date().toISOString(), data: { job_id: "w" } });
  const at = new Date();
  const signature = new Webhook(secret).sign("job:w:completed", at, body);
  const plain = { "webhook-id": "job:w:completed", "webhook-timestamp": String(Math.floor(at.getTime() / 1000)), "webhook-signature": signature };
  const fetchHeaders = new Headers(plain);
  const nodeHeaders: import("node:http").IncomingHttpHeaders = { ...plain, "x-forwarded-for": ["a", "b"] };
  const upper = Object.fromEntries(Object.entries(plain).map(([k, v]) => [k.toUpperCase(), v]));
  for (const headers of [plain, fetchHeaders, nodeHeaders, upper, Object.entries(plain) as Iterable<[string, string]>]) {
    assert.equal(verifyWebhook(secret, body, headers).data.job_id, "w");
  }
  assert.throws(() => verifyWebhook(secret, body + " ", fetchHeaders));
  // One name twice is refused: the consumer could de-duplicate by the other.
  assert.throws(() => verifyWebhook(secret, body, { ...plain, "Webhook-Id": "job:other:completed" }), /twice/);
  assert.throws(
    () => verifyWebhook(secret, body, [...Object.entries(plain), ["webhook-id", "job:other:completed"]] as [string, string][]),
    /twice/,
  );
});

test("every call of the API: batch, re-run, redrive, bulk cancel, schedules, stats, paging", async () => {
  const items = await client.submitBatch([
    { id: "ts-b1", workflow: "completion", input: completion("b1"), delay_ms: 600_000, tags: { batch: "ts" } },
    { id: "ts-b2", workflow: "completion", input: { model: "m", messages: [] } },
  ]);
  assert.deepEqual(items.map((i) => i.status), [201, 422], "one answer per job, in order");
  assert.equal(items[1].error?.field, "input.messages");
  const first = await client.rerun("ts-b1", "ts-b1-again");
  const again = await client.rerun("ts-b1", "ts-b1-again");
  assert.deepEqual([first.created, again.created], [true, false], "a re-run is idempotent by its new id");
  await assert.rejects(client.redrive("ts-b1"), (e: unknown) => e instanceof OnceflowError && e.status === 409 && e.code === "not_dead");
  // The re-run (no delay of its own) runs at once; the delayed original is live.
  assert.equal((await client.wait("ts-b1-again", { timeoutMs: 30_000 })).state, "acked");
  assert.equal(await client.cancelAll({ tag: "batch:ts", reason: "tidy" }), 1, "the one live job of the tag");
  assert.equal((await client.get("ts-b1")).state, "cancelled");
  const seen: string[] = [];
  for await (const job of client.jobs({ limit: 1, tag: "batch:ts" })) seen.push(job.id);
  assert.deepEqual(seen.sort(), ["ts-b1", "ts-b1-again"], "every page, one job each");
  const stats = await client.stats();
  assert.ok((stats.states["cancelled"] ?? 0) >= 1 && (stats.states["acked"] ?? 0) >= 1, JSON.stringify(stats));
  const made = await client.createSchedule({ id: "ts-nightly", cron: "0 3 * * *", workflow: "completion", input: completion("n") });
  assert.equal(made.created, true);
  assert.equal((await client.createSchedule({ id: "ts-nightly", cron: "0 3 * * *", workflow: "completion", input: completion("n") })).created, false);
  assert.equal((await client.pauseSchedule("ts-nightly")).paused, true);
  assert.equal((await client.resumeSchedule("ts-nightly")).paused, false);
  assert.equal((await client.getSchedule("ts-nightly")).id, "ts-nightly");
  const schedules: string[] = [];
  for await (const schedule of client.schedules()) schedules.push(schedule.id);
  assert.ok(schedules.includes("ts-nightly"));
  await client.deleteSchedule("ts-nightly");
  await assert.rejects(client.getSchedule("ts-nightly"), (e: unknown) => e instanceof OnceflowError && e.status === 404);
  const stranger = new Onceflow({ baseUrl: base, token: "not-a-token" });
  await assert.rejects(
    (async () => {
      for await (const _ of stranger.events("ts-b1")) {
        // refused before any event
      }
    })(),
    (e: unknown) => e instanceof OnceflowError && e.status === 401 && e.code === "unauthorized",
  );
});

/**
 * A consumer as a team writes one: verify the raw body with the headers its
 * framework hands over, then drop a repeat by its webhook-id.
 */
class Consumer {
  requests = 0;
  readonly processed: string[] = [];
  private readonly seen = new Set<string>();
  receive(body: string | Uint8Array, headers: Parameters<typeof verifyWebhook>[2], id: string | null): number {
    this.requests += 1;
    const event = verifyWebhook(SECRET, body, headers);
    if (!id || this.seen.has(id)) return 200;
    this.processed.push(String(event.data.job_id)); // the handling, then the mark
    this.seen.add(id);
    return 204;
  }
}

test("webhooks in real servers: Express and Hono verify a real delivery and drop its repeat", async () => {
  const viaExpress = new Consumer();
  const app = express();
  app.post("/hooks", express.raw({ type: "application/json" }), (req, res) => {
    try {
      const id = req.get("webhook-id") ?? null;
      res.sendStatus(viaExpress.receive(req.body as Buffer, req.headers, id));
    } catch {
      res.sendStatus(401);
    }
  });
  const expressServer = app.listen(0, "127.0.0.1");
  await new Promise((ok) => expressServer.once("listening", ok));
  servers.push(expressServer);

  const viaHono = new Consumer();
  const hono = new Hono();
  hono.post("/hooks", async (c) => {
    try {
      const status = viaHono.receive(await c.req.text(), c.req.raw.headers, c.req.header("webhook-id") ?? null);
      return c.body(null, status as 200 | 204);
    } catch {
      return c.body(null, 401);
    }
  });
  const honoServer = await new Promise<Server>((ok) => {
    const server = serveHono({ fetch: hono.fetch, port: 0, hostname: "127.0.0.1" }, () => ok(server as Server));
  });
  servers.push(honoServer);

  const urls = [expressServer, honoServer].map((s) => `http://127.0.0.1:${(s.address() as AddressInfo).port}/hooks`);
  for (const [i, url] of urls.entries()) {
    await client.submit({ id: `ts-fw-${i}`, workflow: "completion", input: completion("fw"), webhook_url: url });
  }
  for (const consumer of [viaExpress, viaHono]) {
    for (let i = 0; i < 150 && consumer.processed.length === 0; i++) await new Promise((ok) => setTimeout(ok, 100));
  }
  assert.deepEqual(viaExpress.processed, ["ts-fw-0"], "Express verified the delivery");
  assert.deepEqual(viaHono.processed, ["ts-fw-1"], "Hono verified the delivery");
  // The same delivery again (a resend after a lost answer) is dropped by its id.
  const delivered = await client.get("ts-fw-0");
  assert.equal(delivered.delivery?.status, "delivered");
  const { Webhook } = await import("standardwebhooks");
  for (const [i, consumer] of [viaExpress, viaHono].entries()) {
    const url = urls[i];
    const at = new Date();
    const body = JSON.stringify({ type: "job.completed", timestamp: at.toISOString(), data: { job_id: `ts-fw-${i}` } });
    const id = `job:ts-fw-${i}:completed`;
    const replay = await fetch(url, {
      method: "POST",
      headers: {
        "content-type": "application/json",
        "webhook-id": id,
        "webhook-timestamp": String(Math.floor(at.getTime() / 1000)),
        "webhook-signature": new Webhook(SECRET).sign(id, at, body),
      },
      body,
    });
    assert.equal(replay.status, 200, "a signed repeat is answered, not processed again");
    const forged = await fetch(url, { method: "POST", headers: { "content-type": "application/json", "webhook-id": "x" }, body });
    assert.equal(forged.status, 401, "an unsigned request is refused");
    assert.equal(consumer.processed.length, 1, "processed once");
  }
});
