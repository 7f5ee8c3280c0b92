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

import { Onceflow, OnceflowError, verifyWebhook } from "../src/index.js";

const SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const BIN = resolve(process.env.ONCEFLOW_BIN ?? "../../target/debug/onceflow");

const modelRequests: string[] = [];
const webhooks: { id: string; event: ReturnType<typeof verifyWebhook> }[] = [];
let servers: Server[] = [];
let serve: ChildProcess;
let client: Onceflow;
let hook: string;
let folder: string;

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
  const token = execFileSync(BIN, ["token", "create", "--name", "ts", "--admin"], {
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
  const base = `http://127.0.0.1:${port}`;
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
});

test("a read's 503 is retried and the bound holds; a write's is not", async () => {
  let seen = 0;
  const flaky = await listen((body) => {
    seen += 1;
    if (body !== "") return [503, JSON.stringify({ error: { code: "unavailable", message: "partly done" } })];
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
  await assert.rejects(patient.cancel("j", "tidy"), (e: unknown) => e instanceof OnceflowError && e.status === 503);
  assert.equal(seen, 1, "a write's 503 is not retried");
});

test("a request past its timeout is given up; a read is retried, a write is not", async () => {
  let seen = 0;
  const silent = createServer(() => {
    seen += 1; // never answers
  });
  servers.push(silent);
  const base: string = await new Promise((ok) =>
    silent.listen(0, "127.0.0.1", () => {
      const address = silent.address();
      ok(`http://127.0.0.1:${typeof address === "object" && address ? address.port : 0}`);
    }),
  );
  const impatient = new Onceflow({ baseUrl: base, timeoutMs: 200, maxRetries: 1 });
  await assert.rejects(impatient.get("j"), (e: unknown) => (e as Error).name === "TimeoutError");
  assert.equal(seen, 2, "a read: one retry after the timeout");
  seen = 0;
  await assert.rejects(impatient.cancel("j"), (e: unknown) => (e as Error).name === "TimeoutError");
  assert.equal(seen, 1, "a write is not sent again");
  silent.closeAllConnections();
});
