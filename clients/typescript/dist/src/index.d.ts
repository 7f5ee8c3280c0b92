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
export declare function resultOf<W extends keyof Results>(job: Job, workflow: W): Results[W] | undefined;
export declare function resultOf<R>(job: Job, workflow: string): R | undefined;
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
    data: {
        text?: string;
        [field: string]: unknown;
    };
}
/** An answer other than 2xx: `{"error": {"code", "message", "field"?}}`. */
export declare class OnceflowError extends Error {
    readonly status: number;
    readonly code: string;
    readonly field?: string | undefined;
    constructor(status: number, code: string, message: string, field?: string | undefined, options?: {
        cause?: unknown;
    });
}
/**
 * No answer: the connection could not be opened, was reset or closed
 * before the answer, after every retry (`status` 0; the fetch error is the
 * `cause`).
 */
export declare class OnceflowConnectionError extends OnceflowError {
    constructor(message: string, cause: unknown, code?: string);
}
/** No answer within `timeoutMs`, after every retry. */
export declare class OnceflowTimeoutError extends OnceflowConnectionError {
    constructor(message: string, cause: unknown);
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
/**
 * The API of one onceflow node. `Submit` (and `Scheduled`) type what
 * `submit`, `submitBatch` and `createSchedule` take: by default any
 * workflow's job; give your node's own document's types for typed inputs,
 * `new Onceflow<components["schemas"]["SubmitJob"]>(…)` with `components`
 * generated by openapi-typescript from your node's `GET /v1/openapi.json`
 * (with a token: one variant per workflow it runs).
 */
export declare class Onceflow<Submit extends {
    id: string;
    workflow: string;
} = SubmitJob | AnyJob, Scheduled extends {
    id: string;
    workflow: string;
} = CreateSchedule | AnySchedule> {
    private readonly api;
    private readonly headers;
    private readonly baseUrl;
    readonly maxRetries: number;
    readonly timeoutMs: number;
    constructor(options: Options);
    /**
     * Submits a job of any workflow (your own too: `workflow` a name, `input`
     * what it takes); the same job again returns the stored one (200).
     */
    submit(job: Submit): Promise<{
        job: Job;
        created: boolean;
    }>;
    /** The job, with its history, journal, waits and children. */
    get(id: string): Promise<Job>;
    /** One page of jobs, newest first; give `next_cursor` back as `cursor`. */
    list(query?: ListQuery): Promise<JobPage>;
    /**
     * Sends a signal (a decision, an event) to a job, recorded once under its
     * id; kept until a wait takes it. The signal as recorded.
     */
    signal(id: string, name: string, body: SignalBody): Promise<Signal>;
    /** Cancels a job (and its children); the job once it is `cancelled`. */
    cancel(id: string, reason?: string): Promise<Job>;
    /**
     * Every job the query matches, newest first, page after page (the keyset
     * cursor followed for you).
     */
    jobs(query?: Omit<ListQuery, "cursor">): AsyncGenerator<components["schemas"]["JobSummary"]>;
    /**
     * Submits up to 1,000 jobs in one request: one answer per job, in order,
     * as a single submit would have answered it (each idempotent by its id).
     */
    submitBatch(jobs: Submit[]): Promise<BatchItem[]>;
    /**
     * A new job `newId` with job `id`'s workflow, input and webhook (the same
     * re-run again is the same new job).
     */
    rerun(id: string, newId: string): Promise<{
        job: Job;
        created: boolean;
    }>;
    /**
     * Resumes a dead job at its last live state, with the same keys;
     * `confirmUnknown` also sends again a webhook whose outcome is unknown.
     */
    redrive(id: string, options?: {
        reason?: string;
        confirmUnknown?: boolean;
    }): Promise<Job>;
    /**
     * Cancels the caller's live jobs that match (an admin token: everyone's);
     * how many were cancelled now. Keyed by no id: sent again only when the
     * server did no work.
     */
    cancelAll(filter?: BulkCancel): Promise<number>;
    /** Redrives the caller's dead jobs that match; sent again only when the server did no work. */
    redriveAll(filter?: BulkRedrive, options?: {
        confirmUnknown?: boolean;
    }): Promise<{
        redriven: number;
        skipped_unknown: number;
    }>;
    /** Jobs by state, and model-token spend against budgets. */
    stats(): Promise<Stats>;
    /** Creates a schedule (the same schedule again is the stored one). */
    createSchedule(schedule: Scheduled): Promise<{
        schedule: Schedule;
        created: boolean;
    }>;
    /** A schedule, with its latest jobs. */
    getSchedule(id: string): Promise<ScheduleDetail>;
    /** Every schedule the caller sees, by id, page after page. */
    schedules(): AsyncGenerator<Schedule>;
    /** Pauses a schedule: nothing fires until it is resumed. */
    pauseSchedule(id: string): Promise<ScheduleDetail>;
    /** Resumes a schedule at its next fire time from now. */
    resumeSchedule(id: string): Promise<ScheduleDetail>;
    /** Deletes a schedule (its jobs stay); deleting it again is `404`. */
    deleteSchedule(id: string): Promise<void>;
    /** Waits for the job to be final (acked, dead or cancelled) and returns it. */
    wait(id: string, options?: {
        timeoutMs?: number;
    }): Promise<Job>;
    /**
     * The job's events as they are journaled, after `lastEventId`. A dropped
     * connection is resumed with `Last-Event-ID` (by `eventsource`, with its
     * backoff, without end), and a 429 or 5xx answer asked again after its
     * Retry-After (`maxRetries` times per connection; then the iteration
     * throws its `OnceflowError`), so nothing is lost or repeated; the iteration ends after the
     * job's final state, or at once when resumed past the end of a finished
     * job (204).
     */
    events(id: string, options?: {
        lastEventId?: number;
    }): AsyncGenerator<JobEvent>;
    /**
     * Sends `request`, again on a busy or failed answer or no answer (see the
     * module's comment); `idempotent` false (a call keyed by no id) is sent
     * again only when the server did no work: a `429`, or a connection never
     * opened.
     */
    private call;
}
/** Answers a call is sent again after: busy, or the server or a proxy failed. */
export declare const RETRIED_STATUSES: readonly number[];
/**
 * Verifies one of onceflow's webhooks (Standard Webhooks) with any of the
 * `whsec_` secrets given, and returns its event; throws when none verifies.
 * De-duplicate what it returns by the `webhook-id` header: a resend after a
 * lost answer is the same event.
 */
export declare function verifyWebhook(secrets: string | string[], body: string | Uint8Array, headers: WebhookHeaders): {
    type: string;
    timestamp: string;
    data: Record<string, unknown>;
};
/**
 * The headers a framework hands a handler: a fetch `Headers` (a `Request`'s,
 * in Next.js, Hono, Deno, Bun), Node's `IncomingHttpHeaders` (Express,
 * `node:http`: a value may be a list or absent), or a plain record.
 */
export type WebhookHeaders = Headers | Record<string, string | string[] | undefined> | Iterable<[string, string]>;
