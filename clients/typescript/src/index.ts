/**
 * A client for onceflow's HTTP API. Its types come from the served OpenAPI
 * document (`src/schema.ts`, made by openapi-typescript; `npm run generate`
 * with `ONCEFLOW_OPENAPI` naming a saved `GET /v1/openapi.json`), its
 * requests go through openapi-fetch, a job's events are followed with
 * `eventsource`, and webhooks are verified with `standardwebhooks`.
 *
 * ```ts
 * const client = new Onceflow({ baseUrl: "http://127.0.0.1:8080", token: process.env.ONCEFLOW_TOKEN });
 * await client.submit({ id: "order-42", workflow: "completion", input: { model: "gpt-4o-mini", messages } });
 * for await (const event of client.events("order-42")) console.log(event.kind, event.data);
 * const job = await client.wait("order-42", { timeoutMs: 60_000 });
 * ```
 *
 * Retried, at most `maxRetries` times, with full-jitter backoff (a random
 * pause up to 250 ms × 2^attempt, at most 8 s) or after the answer's
 * `Retry-After` (at most 30 s): every call on `429`, `500`, `502`, `503`
 * and `504`, a connection refused, reset or closed mid-answer, and a
 * timeout. That is safe because every write of the API is idempotent by
 * its id: a submit sent again is the same job (`200`, `created` false), a
 * signal the same signal, a cancel the same cancel, a schedule's delete
 * done once. A redrive and the bulk calls are sent again only when the
 * server did no work. A failure that outlasts the retries rejects with
 * `OnceflowConnectionError`
 * (`OnceflowTimeoutError` for a timeout), the fetch error as its `cause`.
 */
import createClient from "openapi-fetch";
import { EventSource } from "eventsource";
import { Webhook } from "standardwebhooks";

import type { components, paths } from "./schema.js";

export type { components, paths };
/** A job as `GET /v1/jobs/{id}` shows it. */
export type Job = components["schemas"]["JobView"];
/** `POST /v1/jobs`'s body: one variant per workflow this package's document knows. */
export type SubmitJob = components["schemas"]["SubmitJob"];
/**
 * `POST /v1/jobs`'s body for any workflow, your own included: `workflow`
 * a name, `input` whatever it takes (the node checks it, `422` naming the
 * field). Generate types from your own node's document for typed inputs.
 */
export type AnyJob = Omit<components["schemas"]["SubmitJob_completion"], "workflow" | "input"> & {
  workflow: string;
  input: unknown;
};
/** A page of `GET /v1/jobs`. */
export type JobPage = components["schemas"]["JobPage"];

/**
 * What a finished job of each built-in workflow returns: the document's
 * `Result_{workflow}` components.
 */
export type Results = {
  completion: components["schemas"]["Result_completion"];
  agent: components["schemas"]["Result_agent"];
};

/**
 * A job's `result`, typed by its workflow: `Results[W]` for a built-in,
 * or the type you give for your own (from your node's document,
 * `components["schemas"]["Result_greet"]`). `undefined` while the job has
 * no result, or when it is another workflow's job.
 */
export function resultOf<W extends keyof Results>(job: Job, workflow: W): Results[W] | undefined;
export function resultOf<R>(job: Job, workflow: string): R | undefined;
export function resultOf(job: Job, workflow: string): unknown {
  return job.workflow === workflow && job.result != null ? job.result : undefined;
}
/** What `GET /v1/jobs` filters on. */
export type ListQuery = NonNullable<paths["/v1/jobs"]["get"]["parameters"]["query"]>;
/** A signal: its sender's id and its payload. */
export type SignalBody = components["schemas"]["SignalBody"];
/** A signal as recorded. */
export type Signal = components["schemas"]["SignalView"];
/** One job's answer in a batch: `status`, and `job` or `error`. */
export type BatchItem = components["schemas"]["BatchItem"];
/** A schedule, with its next fire time. */
export type Schedule = components["schemas"]["ScheduleView"];
/** A schedule with its latest jobs. */
export type ScheduleDetail = components["schemas"]["ScheduleDetail"];
/** `POST /v1/schedules`'s body: one variant per workflow this package's document knows. */
export type CreateSchedule = components["schemas"]["CreateSchedule"];
/** A schedule of any workflow, your own included. */
export type AnySchedule = Omit<components["schemas"]["CreateSchedule_completion"], "workflow" | "input"> & {
  workflow: string;
  input: unknown;
};
/** Jobs by state, and model-token spend against budgets. */
export type Stats = components["schemas"]["Stats"];
/** A job's state. */
export type JobState = components["schemas"]["JobState"];
/** What `cancelAll` takes. */
export type BulkCancel = components["schemas"]["BulkCancel"];
/** What `redriveAll` takes. */
export type BulkRedrive = components["schemas"]["BulkRedrive"];

/** One event of a job's stream. */
export interface JobEvent {
  /** Its id: give it back as `lastEventId` to resume after it. */
  id: number;
  /** `state`, `chunk`, `tool` or `reset`. */
  kind: string;
  /** `{"text", …}`: a state's name, or a chunk of the answer. */
  data: { text?: string; [field: string]: unknown };
}

const TERMINAL = new Set(["acked", "dead", "cancelled"]);

/** An answer other than 2xx: `{"error": {"code", "message", "field"?}}`. */
export class OnceflowError extends Error {
  constructor(
    readonly status: number,
    readonly code: string,
    message: string,
    readonly field?: string,
    options?: { cause?: unknown },
  ) {
    super(`${status} ${code}: ${message}${field ? ` (field ${field})` : ""}`, options);
    this.name = "OnceflowError";
  }
}

/**
 * No answer: the connection could not be opened, was reset or closed
 * before the answer, after every retry (`status` 0; the fetch error is the
 * `cause`).
 */
export class OnceflowConnectionError extends OnceflowError {
  constructor(message: string, cause: unknown, code = "connection") {
    super(0, code, message, undefined, { cause });
    this.name = "OnceflowConnectionError";
  }
}

/** No answer within `timeoutMs`, after every retry. */
export class OnceflowTimeoutError extends OnceflowConnectionError {
  constructor(message: string, cause: unknown) {
    super(message, cause, "timeout");
    this.name = "OnceflowTimeoutError";
  }
}

export interface Options {
  /** The node's base URL (any node: they share the database). */
  baseUrl: string;
  /** An API token (`onceflow token create`); none in development mode. */
  token?: string;
  /** Retries of a 429, a 5xx, a failed connection or a timeout (default 3). */
  maxRetries?: number;
  /**
   * How long one request may take, in milliseconds (default 30,000); one
   * that runs over is retried, then rejects with `OnceflowTimeoutError`.
   * The event stream has no such bound.
   */
  timeoutMs?: number;
}

type Answer<T> = { data?: T; error?: unknown; response: Response };

/**
 * The API of one onceflow node. `Submit` (and `Scheduled`) type what
 * `submit`, `submitBatch` and `createSchedule` take: by default any
 * workflow's job; give your node's own document's types for typed inputs,
 * `new Onceflow<components["schemas"]["SubmitJob"]>(…)` with `components`
 * generated by openapi-typescript from your node's `GET /v1/openapi.json`
 * (with a token: one variant per workflow it runs).
 */
export class Onceflow<
  Submit extends { id: string; workflow: string } = SubmitJob | AnyJob,
  Scheduled extends { id: string; workflow: string } = CreateSchedule | AnySchedule,
> {
  private readonly api;
  private readonly headers: Record<string, string>;
  private readonly baseUrl: string;
  readonly maxRetries: number;
  readonly timeoutMs: number;

  constructor(options: Options) {
    this.baseUrl = options.baseUrl.replace(/\/+$/, "");
    this.headers = options.token ? { Authorization: `Bearer ${options.token}` } : {};
    this.maxRetries = options.maxRetries ?? 3;
    this.timeoutMs = options.timeoutMs ?? 30_000;
    this.api = createClient<paths>({
      baseUrl: this.baseUrl,
      headers: this.headers,
      fetch: (request: Request) => fetch(request, { signal: AbortSignal.timeout(this.timeoutMs) }),
    });
  }

  /**
   * Submits a job of any workflow (your own too: `workflow` a name, `input`
   * what it takes); the same job again returns the stored one (200).
   */
  async submit(job: Submit): Promise<{ job: Job; created: boolean }> {
    const answer = await this.call(() => this.api.POST("/v1/jobs", { body: job as unknown as SubmitJob }));
    return { job: answer.data as Job, created: answer.response.status === 201 };
  }

  /** The job, with its history, journal, waits and children. */
  async get(id: string): Promise<Job> {
    const answer = await this.call(() => this.api.GET("/v1/jobs/{id}", { params: { path: { id } } }));
    return answer.data as Job;
  }

  /** One page of jobs, newest first; give `next_cursor` back as `cursor`. */
  async list(query: ListQuery = {}): Promise<JobPage> {
    const answer = await this.call(() => this.api.GET("/v1/jobs", { params: { query } }));
    return answer.data as JobPage;
  }

  /**
   * Sends a signal (a decision, an event) to a job, recorded once under its
   * id; kept until a wait takes it. The signal as recorded.
   */
  async signal(id: string, name: string, body: SignalBody): Promise<Signal> {
    const answer = await this.call(() =>
      this.api.POST("/v1/jobs/{id}/signals/{name}", { params: { path: { id, name } }, body }),
    );
    return answer.data as Signal;
  }

  /** Cancels a job (and its children); the job once it is `cancelled`. */
  async cancel(id: string, reason?: string): Promise<Job> {
    const answer = await this.call(() =>
      this.api.POST("/v1/jobs/{id}/cancel", { params: { path: { id } }, body: reason ? { reason } : {} }),
    );
    return answer.data as Job;
  }

  /**
   * Every job the query matches, newest first, page after page (the keyset
   * cursor followed for you).
   */
  async *jobs(query: Omit<ListQuery, "cursor"> = {}): AsyncGenerator<components["schemas"]["JobSummary"]> {
    let cursor: string | undefined;
    for (;;) {
      const page = await this.list({ ...query, cursor });
      yield* page.jobs;
      if (!page.next_cursor) return;
      cursor = page.next_cursor;
    }
  }

  /**
   * Submits up to 1,000 jobs in one request: one answer per job, in order,
   * as a single submit would have answered it (each idempotent by its id).
   */
  async submitBatch(jobs: Submit[]): Promise<BatchItem[]> {
    const answer = await this.call(() =>
      this.api.POST("/v1/jobs/batch", { body: { jobs: jobs as unknown as Record<string, unknown>[] } }),
    );
    return (answer.data as { jobs: BatchItem[] }).jobs;
  }

  /**
   * A new job `newId` with job `id`'s workflow, input and webhook (the same
   * re-run again is the same new job).
   */
  async rerun(id: string, newId: string): Promise<{ job: Job; created: boolean }> {
    const answer = await this.call(() =>
      this.api.POST("/v1/jobs/{id}/rerun", { params: { path: { id } }, body: { id: newId } }),
    );
    return { job: answer.data as Job, created: answer.response.status === 201 };
  }

  /**
   * Resumes a dead job at its last live state, with the same keys;
   * `confirmUnknown` also sends again a webhook whose outcome is unknown.
   */
  async redrive(id: string, options: { reason?: string; confirmUnknown?: boolean } = {}): Promise<Job> {
    const query = options.confirmUnknown ? { confirm_unknown: true } : undefined;
    const body = options.reason ? { reason: options.reason } : {};
    // Done twice, a redrive could redrive a job that died again meanwhile:
    // sent again only when the server did no work.
    const answer = await this.call(
      () => this.api.POST("/v1/jobs/{id}/redrive", { params: { path: { id }, query }, body }),
      false,
    );
    return answer.data as Job;
  }

  /**
   * Cancels the caller's live jobs that match (an admin token: everyone's);
   * how many were cancelled now. Keyed by no id: sent again only when the
   * server did no work.
   */
  async cancelAll(filter: BulkCancel = {}): Promise<number> {
    const answer = await this.call(() => this.api.POST("/v1/jobs/cancel", { body: filter }), false);
    return (answer.data as { cancelled: number }).cancelled;
  }

  /** Redrives the caller's dead jobs that match; sent again only when the server did no work. */
  async redriveAll(
    filter: BulkRedrive = {},
    options: { confirmUnknown?: boolean } = {},
  ): Promise<{ redriven: number; skipped_unknown: number }> {
    const query = options.confirmUnknown ? { confirm_unknown: true } : undefined;
    const answer = await this.call(
      () => this.api.POST("/v1/jobs/redrive", { params: { query }, body: filter }),
      false,
    );
    return answer.data as { redriven: number; skipped_unknown: number };
  }

  /** Jobs by state, and model-token spend against budgets. */
  async stats(): Promise<Stats> {
    const answer = await this.call(() => this.api.GET("/v1/stats"));
    return answer.data as Stats;
  }

  /** Creates a schedule (the same schedule again is the stored one). */
  async createSchedule(schedule: Scheduled): Promise<{ schedule: Schedule; created: boolean }> {
    const answer = await this.call(() =>
      this.api.POST("/v1/schedules", { body: schedule as unknown as CreateSchedule }),
    );
    return { schedule: answer.data as Schedule, created: answer.response.status === 201 };
  }

  /** A schedule, with its latest jobs. */
  async getSchedule(id: string): Promise<ScheduleDetail> {
    const answer = await this.call(() => this.api.GET("/v1/schedules/{id}", { params: { path: { id } } }));
    return answer.data as ScheduleDetail;
  }

  /** Every schedule the caller sees, by id, page after page. */
  async *schedules(): AsyncGenerator<Schedule> {
    let cursor: string | undefined;
    for (;;) {
      const answer = await this.call(() => this.api.GET("/v1/schedules", { params: { query: { cursor } } }));
      const page = answer.data as { schedules: Schedule[]; next_cursor?: string | null };
      yield* page.schedules;
      if (!page.next_cursor) return;
      cursor = page.next_cursor;
    }
  }

  /** Pauses a schedule: nothing fires until it is resumed. */
  async pauseSchedule(id: string): Promise<ScheduleDetail> {
    const answer = await this.call(() => this.api.POST("/v1/schedules/{id}/pause", { params: { path: { id } } }));
    return answer.data as ScheduleDetail;
  }

  /** Resumes a schedule at its next fire time from now. */
  async resumeSchedule(id: string): Promise<ScheduleDetail> {
    const answer = await this.call(() => this.api.POST("/v1/schedules/{id}/resume", { params: { path: { id } } }));
    return answer.data as ScheduleDetail;
  }

  /** Deletes a schedule (its jobs stay); deleting it again is `404`. */
  async deleteSchedule(id: string): Promise<void> {
    await this.call(() => this.api.DELETE("/v1/schedules/{id}", { params: { path: { id } } }), true, true);
  }

  /** Waits for the job to be final (acked, dead or cancelled) and returns it. */
  async wait(id: string, options: { timeoutMs?: number } = {}): Promise<Job> {
    const deadline = options.timeoutMs === undefined ? undefined : Date.now() + options.timeoutMs;
    let pause = 50;
    for (;;) {
      const job = await this.get(id);
      if (TERMINAL.has(job.state)) return job;
      if (deadline !== undefined && Date.now() >= deadline) {
        throw new Error(`job ${id} is still ${job.state} after ${options.timeoutMs} ms`);
      }
      const left = deadline === undefined ? pause : Math.max(0, Math.min(pause, deadline - Date.now()));
      await sleep(left);
      pause = Math.min(pause * 2, 1000);
    }
  }

  /**
   * The job's events as they are journaled, after `lastEventId`. A dropped
   * connection is resumed with `Last-Event-ID` (by `eventsource`, with its
   * backoff, without end), and a 429 or 5xx answer asked again after its
   * Retry-After (`maxRetries` times per connection; then the iteration
   * throws its `OnceflowError`), so nothing is lost or repeated; the iteration ends after the
   * job's final state, or at once when resumed past the end of a finished
   * job (204).
   */
  async *events(id: string, options: { lastEventId?: number } = {}): AsyncGenerator<JobEvent> {
    const tries = Number.isFinite(this.maxRetries) ? Math.max(0, this.maxRetries) : 3;
    const headers: Record<string, string> = { ...this.headers };
    if (options.lastEventId !== undefined) headers["Last-Event-ID"] = String(options.lastEventId);
    const queue: (JobEvent | Error | null)[] = [];
    let wake: (() => void) | undefined;
    const push = (item: JobEvent | Error | null) => {
      queue.push(item);
      wake?.();
      wake = undefined;
    };
    const source = new EventSource(`${this.baseUrl}/v1/jobs/${encodeURIComponent(id)}/events`, {
      // Ours under eventsource's own: on a reconnect its Last-Event-ID
      // (the last event received) wins over the one we started from.
      // A busy or failing answer (429, 5xx: a restart, a proxy) is asked
      // again after its Retry-After, from the same event, within the
      // client's retries; eventsource itself reconnects a dropped one.
      fetch: async (input, init) => {
        const merged = new Headers(init?.headers);
        for (const [name, value] of Object.entries(headers)) {
          if (!merged.has(name)) merged.set(name, value);
        }
        for (let attempt = 0; ; attempt++) {
          const response = await fetch(input, { ...init, headers: merged });
          if (!RETRIED_STATUSES.includes(response.status) || attempt >= tries) return response;
          await response.body?.cancel();
          await sleep(retryAfter(response, attempt), init?.signal);
        }
      },
    });
    for (const kind of ["state", "chunk", "tool", "reset"]) {
      source.addEventListener(kind, (e) => {
        push({ id: Number(e.lastEventId), kind, data: JSON.parse(e.data) });
      });
    }
    source.onerror = (e) => {
      // Closed for good: a 204 (nothing more to say), or a refusal.
      if (source.readyState === EventSource.CLOSED) {
        const status = (e as { code?: number }).code;
        push(
          status === undefined || status === 204
            ? null
            : new OnceflowError(status, STREAM_REFUSALS[status] ?? "http", e.message ?? "refused"),
        );
      }
    };
    try {
      for (;;) {
        while (queue.length === 0) await new Promise<void>((resolve) => (wake = resolve));
        const next = queue.shift();
        if (next === null || next === undefined) return;
        if (next instanceof Error) throw next;
        yield next;
        if (next.kind === "state" && TERMINAL.has(String(next.data.text))) return;
      }
    } finally {
      source.close();
    }
  }

  /**
   * Sends `request`, again on a busy or failed answer or no answer (see the
   * module's comment); `idempotent` false (a call keyed by no id) is sent
   * again only when the server did no work: a `429`, or a connection never
   * opened.
   */
  private async call<T>(
    request: () => Promise<Answer<T>>,
    idempotent = true,
    goneOk = false,
  ): Promise<Answer<T>> {
    const tries = Number.isFinite(this.maxRetries) ? Math.max(0, this.maxRetries) : 3;
    for (let attempt = 0; ; attempt++) {
      const last = attempt >= tries;
      let answer: Answer<T>;
      try {
        answer = await request();
      } catch (e) {
        // Only a failure of the network is sent again and made our own
        // error; any other (a body that does not serialise) is the caller's.
        if (!isNetwork(e)) throw e;
        if (last || !(idempotent || neverSent(e))) throw noAnswer(e);
        await sleep(backoff(attempt));
        continue;
      }
      const status = answer.response.status;
      // A delete whose earlier send got no answer: its 404 is that send's work.
      if (goneOk && attempt > 0 && status === 404) return answer;
      const again = idempotent ? RETRIED_STATUSES.includes(status) : status === 429;
      if (again && !last) {
        await sleep(retryAfter(answer.response, attempt));
        continue;
      }
      if (status < 200 || status >= 300) {
        const body = (answer.error ?? {}) as { error?: { code?: string; message?: string; field?: string } };
        throw new OnceflowError(
          status,
          body.error?.code ?? "http",
          body.error?.message ?? answer.response.statusText,
          body.error?.field,
        );
      }
      return answer;
    }
  }
}

/**
 * The API's code for a stream refused with this status (an event stream's
 * answer has no body to read it from).
 */
const STREAM_REFUSALS: Record<number, string> = {
  401: "unauthorized",
  403: "cross_site",
  404: "not_found",
  400: "invalid_header",
  421: "misdirected",
  422: "invalid_request",
  429: "too_many_streams",
  503: "unavailable",
};

/** Answers a call is sent again after: busy, or the server or a proxy failed. */
export const RETRIED_STATUSES: readonly number[] = [429, 500, 502, 503, 504];

/** The client's own error for a request that got no answer (its cause kept). */
function noAnswer(e: unknown): OnceflowConnectionError {
  const name = (e as { name?: string })?.name;
  if (name === "TimeoutError" || name === "AbortError") {
    return new OnceflowTimeoutError("no answer in time", e);
  }
  const cause = (e as { cause?: { code?: string; message?: string } })?.cause;
  return new OnceflowConnectionError(cause?.code ?? cause?.message ?? String(e), e);
}

/**
 * Verifies one of onceflow's webhooks (Standard Webhooks) with any of the
 * `whsec_` secrets given, and returns its event; throws when none verifies.
 * De-duplicate what it returns by the `webhook-id` header: a resend after a
 * lost answer is the same event.
 */
export function verifyWebhook(
  secrets: string | string[],
  body: string | Uint8Array,
  headers: WebhookHeaders,
): { type: string; timestamp: string; data: Record<string, unknown> } {
  const lowered = plainHeaders(headers);
  let failure: unknown;
  for (const secret of Array.isArray(secrets) ? secrets : [secrets]) {
    try {
      return new Webhook(secret).verify(body, lowered) as ReturnType<typeof verifyWebhook>;
    } catch (e) {
      failure = e;
    }
  }
  throw failure ?? new Error("no secret given");
}

/**
 * The headers a framework hands a handler: a fetch `Headers` (a `Request`'s,
 * in Next.js, Hono, Deno, Bun), Node's `IncomingHttpHeaders` (Express,
 * `node:http`: a value may be a list or absent), or a plain record.
 */
export type WebhookHeaders =
  | Headers
  | Record<string, string | string[] | undefined>
  | Iterable<[string, string]>;

/** `headers` as one lower-case name to one value. */
function plainHeaders(headers: WebhookHeaders): Record<string, string> {
  const out: Record<string, string> = {};
  const put = (name: string, value: string | string[] | undefined) => {
    if (value === undefined) return;
    const lower = name.toLowerCase();
    // One name twice (`webhook-id` and `Webhook-Id`, a pair repeated) could
    // verify one value while the consumer de-duplicates by the other.
    if (lower in out) throw new Error(`the header ${lower} is given twice`);
    out[lower] = Array.isArray(value) ? value.join(", ") : value;
  };
  // A fetch `Headers` (and any list of pairs) iterates its pairs.
  if (Symbol.iterator in Object(headers) && !isRecord(headers)) {
    for (const [name, value] of headers as Iterable<[string, string]>) put(name, value);
  } else {
    for (const [name, value] of Object.entries(headers as Record<string, string | string[] | undefined>)) {
      put(name, value);
    }
  }
  return out;
}

function isRecord(value: unknown): boolean {
  const proto = Object.getPrototypeOf(value);
  return proto === Object.prototype || proto === null;
}

/** A connection that could not be opened: the request never left. */
function neverSent(e: unknown): boolean {
  const code = (e as { cause?: { code?: string } })?.cause?.code;
  return (
    code === "ECONNREFUSED" || code === "ENOTFOUND" || code === "EAI_AGAIN" || code === "UND_ERR_CONNECT_TIMEOUT"
  );
}

/** A failure of the network (fetch's `TypeError` with a cause) or our timeout. */
function isNetwork(e: unknown): boolean {
  const name = (e as { name?: string })?.name;
  if (name === "TimeoutError" || name === "AbortError") return true;
  return e instanceof TypeError && (e as { cause?: unknown }).cause !== undefined;
}

/** Full jitter: a random pause up to the attempt's exponential bound. */
function backoff(attempt: number): number {
  return Math.random() * Math.min(250 * 2 ** attempt, 8000);
}

/** The answer's `Retry-After` (seconds or an HTTP date; at most 30 s), or a backoff. */
function retryAfter(response: Response, attempt: number): number {
  const value = response.headers.get("retry-after")?.trim();
  if (!value) return backoff(attempt);
  const seconds = /^\d+$/.test(value) ? Number(value) : (Date.parse(value) - Date.now()) / 1000;
  return Number.isFinite(seconds) ? Math.min(Math.max(seconds, 0), 30) * 1000 : backoff(attempt);
}

/** Resolves after `ms`, or rejects at once when `signal` aborts (a closed stream). */
function sleep(ms: number, signal?: AbortSignal | null): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) return reject(signal.reason);
    const onAbort = () => {
      clearTimeout(timer);
      reject(signal?.reason);
    };
    const timer = setTimeout(() => {
      signal?.removeEventListener("abort", onAbort);
      resolve();
    }, ms);
    signal?.addEventListener("abort", onAbort, { once: true });
  });
}
