// Smoke test of a client generated from the served document
// (scripts/generated-clients): types by openapi-typescript, requests by
// openapi-fetch; submit, get, list, signal and cancel against a real
// `serve`. Type-checked by tsc (the README's minimal request must compile),
// then run by node with ONCEFLOW_URL and ONCEFLOW_TOKEN set.
import createClient from "openapi-fetch";
import type { paths } from "./schema.js";

const client = createClient<paths>({
  baseUrl: process.env.ONCEFLOW_URL,
  headers: { Authorization: `Bearer ${process.env.ONCEFLOW_TOKEN}` },
});

function check(ok: boolean, what: string, detail?: unknown): void {
  if (!ok) {
    console.error(`generated TypeScript client: ${what}`, detail);
    process.exit(1);
  }
}

const id = `gen-ts-${process.pid}`;
// The README's request, no default spelled out; a delay so it waits.
const submitted = await client.POST("/v1/jobs", {
  body: {
    id,
    workflow: "completion",
    input: { model: "m", messages: [{ role: "user", content: "hi" }] },
    delay_ms: 3_600_000,
    concurrency_key: "customer-1",
  },
});
check(submitted.response.status === 201, "submit is 201", submitted.error);
check(submitted.data?.id === id && submitted.data?.state === "received", "the job as created", submitted.data);

const got = await client.GET("/v1/jobs/{id}", { params: { path: { id } } });
check(got.data?.concurrency_key === "customer-1", "get shows the job", got.data ?? got.error);

const page = await client.GET("/v1/jobs", { params: { query: { limit: 10 } } });
check(page.data?.jobs.some((j) => j.id === id) === true, "the list has it", page.data ?? page.error);

const sent = await client.POST("/v1/jobs/{id}/signals/{name}", {
  params: { path: { id, name: "go" } },
  body: { id: "s-1", payload: { ok: true } },
});
check(sent.response.status === 202, "a signal is 202", sent.error);

const cancelled = await client.POST("/v1/jobs/{id}/cancel", {
  params: { path: { id } },
  body: { reason: "smoke test" },
});
check(cancelled.response.status === 202, "cancel is 202", cancelled.error);
const after = await client.GET("/v1/jobs/{id}", { params: { path: { id } } });
check(after.data?.state === "cancelled", "the job is cancelled", after.data);
console.error("generated TypeScript client: submit, get, list, signal, cancel: ok");
