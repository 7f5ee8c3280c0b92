//! [`Client`]: the typed Rust client of the HTTP API. Jobs of a workflow
//! type are submitted with its typed input; every API error is a typed
//! [`ClientError`].

use std::time::Duration;

use onceflow_engine::{ErrorEnvelope, JobState, Workflow};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// A client of one onceflow server.
#[derive(Debug, Clone)]
pub struct Client {
    base: String,
    token: Option<String>,
    http: reqwest::Client,
}

/// What the API answered, when it was not a success.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// `409`: the id holds another request, or a job not in the state the
    /// action needs (not dead, already finished, delivery unknown).
    #[error("409 conflict ({code}): {message}")]
    Conflict {
        /// The API's error code.
        code: String,
        /// What the server said.
        message: String,
    },
    /// `422`: `field` is invalid.
    #[error("422 invalid {field}: {message}")]
    Invalid {
        /// The offending field (`input.messages`, `webhook_url`, …).
        field: String,
        /// What is wrong with it.
        message: String,
    },
    /// `429`: come back after `retry_after`.
    #[error("429 rate limited ({message}); retry after {retry_after:?}")]
    RateLimited {
        /// The server's `Retry-After`, if it sent one.
        retry_after: Option<Duration>,
        /// What the server said.
        message: String,
    },
    /// `404`: no such job (or another token's).
    #[error("404 not found: {0}")]
    NotFound(String),
    /// `401`: the token is missing, unknown or revoked.
    #[error("401 unauthorized: {0}")]
    Unauthorized(String),
    /// `503`: the server is draining or its database is unavailable.
    #[error("503 unavailable ({message}); retry after {retry_after:?}")]
    Unavailable {
        /// The server's `Retry-After`, if it sent one.
        retry_after: Option<Duration>,
        /// What the server said.
        message: String,
    },
    /// Any other answer.
    #[error("HTTP {status} ({code}): {message}")]
    Other {
        /// The HTTP status.
        status: u16,
        /// The API's error code (empty if the body had none).
        code: String,
        /// What the server said.
        message: String,
    },
    /// The server could not be reached or its answer not read.
    #[error("cannot reach the onceflow server: {0}")]
    Transport(#[from] reqwest::Error),
}

/// One row of the history of a job.
#[derive(Debug, Clone, Deserialize)]
pub struct HistoryRow {
    /// The state entered.
    pub state: JobState,
    /// When it was entered.
    pub at: chrono::DateTime<chrono::Utc>,
    /// The attempt that made the transition (0 at intake).
    pub attempt: i32,
    /// The node that made it, `intake`, or the operator who asked.
    pub worker: String,
    /// Who asked and why, for an operator's transition (redrive, cancel).
    #[serde(default)]
    pub note: Option<String>,
}

/// A job as the API shows it; `Output` is the workflow's result type.
#[derive(Debug, Clone, Deserialize)]
#[serde(bound = "O: DeserializeOwned")]
pub struct Job<O = Value> {
    /// The job id (your business id).
    pub id: String,
    /// The name of the workflow it runs.
    pub workflow: String,
    /// The version of the workflow the job started on (and runs on).
    pub workflow_version: i32,
    /// Where the job is in its lifecycle.
    pub state: JobState,
    /// Attempts started so far.
    pub attempts: i32,
    /// Which life of the id this is (1 unless it was purged and submitted again).
    pub incarnation: i32,
    /// The workflow's output, once persisted.
    pub result: Option<O>,
    /// Every transition, oldest first.
    pub history: Vec<HistoryRow>,
    /// The most recent failure, if any.
    pub last_error: Option<ErrorEnvelope>,
    /// Why the job is dead, if it is.
    pub dead_reason: Option<String>,
    /// The W3C trace id (hex) every attempt of the job runs under.
    pub trace_id: Option<String>,
}

/// One job in a list.
#[derive(Debug, Clone, Deserialize)]
pub struct JobSummary {
    /// The job id.
    pub id: String,
    /// The name of the workflow it runs.
    pub workflow: String,
    /// The version of the workflow it started on (and runs on).
    pub workflow_version: i32,
    /// Where the job is in its lifecycle.
    pub state: JobState,
    /// Attempts started so far.
    pub attempts: i32,
    /// When the job was submitted.
    pub created_at: chrono::DateTime<chrono::Utc>,
    /// Why the job is dead, if it is.
    pub dead_reason: Option<String>,
}

/// A page of jobs, newest first; `next_cursor` continues it.
#[derive(Debug, Clone, Deserialize)]
pub struct Page {
    /// The jobs of this page, newest first.
    pub jobs: Vec<JobSummary>,
    /// Pass as [`ListQuery::cursor`] for the next page; `None` on the last.
    pub next_cursor: Option<String>,
}

/// Which jobs to list.
#[derive(Debug, Clone, Default)]
pub struct ListQuery {
    /// Only jobs in this state.
    pub state: Option<JobState>,
    /// Only jobs of this workflow.
    pub workflow: Option<String>,
    /// Jobs per page, 1 to 500 (server default 50).
    pub limit: Option<u32>,
    /// A previous page's `next_cursor`, to continue after it.
    pub cursor: Option<String>,
}

/// A submission's answer: `created` (`201`) or an identical one (`200`).
#[derive(Debug, Clone)]
pub struct Submitted<O = Value> {
    /// `true` when this submission created the job, `false` when it matched an existing one.
    pub created: bool,
    /// The job as stored.
    pub job: Job<O>,
}

impl Client {
    /// A client of the server at `base` (e.g. `http://127.0.0.1:8080`).
    pub fn new(base: impl Into<String>) -> Self {
        Client {
            base: base.into().trim_end_matches('/').to_owned(),
            token: None,
            http: reqwest::Client::new(),
        }
    }

    /// Sends `Authorization: Bearer <token>` with every request.
    pub fn with_token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        self
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let r = self.http.request(method, format!("{}{path}", self.base));
        match &self.token {
            Some(t) => r.bearer_auth(t),
            None => r,
        }
    }

    async fn answer<T: DeserializeOwned>(
        response: reqwest::Response,
    ) -> Result<(u16, T), ClientError> {
        let status = response.status().as_u16();
        let retry_after = response
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(Duration::from_secs);
        if (200..300).contains(&status) {
            return Ok((status, response.json().await?));
        }
        let body: Value = response.json().await.unwrap_or(Value::Null);
        let text = |k: &str| body["error"][k].as_str().unwrap_or_default().to_owned();
        let (code, message) = (text("code"), text("message"));
        Err(match status {
            409 => ClientError::Conflict { code, message },
            422 => ClientError::Invalid {
                field: text("field"),
                message,
            },
            429 => ClientError::RateLimited {
                retry_after,
                message,
            },
            404 => ClientError::NotFound(message),
            401 => ClientError::Unauthorized(message),
            503 => ClientError::Unavailable {
                retry_after,
                message,
            },
            _ => ClientError::Other {
                status,
                code,
                message,
            },
        })
    }

    /// Submits a job of workflow `W` with its typed `input`; its outcome is
    /// POSTed to `webhook_url`, or nowhere when it is empty (follow the
    /// job with [`job`](Self::job) instead).
    pub async fn submit<W>(
        &self,
        id: &str,
        input: &W::Input,
        webhook_url: &str,
    ) -> Result<Submitted<W::Output>, ClientError>
    where
        W: Workflow,
        W::Input: Serialize,
        W::Output: DeserializeOwned,
    {
        self.submit_raw(W::NAME, id, &json!(input), webhook_url)
            .await
    }

    /// Submits a job of the workflow named `workflow` with a JSON `input`.
    pub async fn submit_raw<O: DeserializeOwned>(
        &self,
        workflow: &str,
        id: &str,
        input: &Value,
        webhook_url: &str,
    ) -> Result<Submitted<O>, ClientError> {
        let mut body = json!({ "id": id, "workflow": workflow, "input": input });
        // An empty URL: a job without a webhook.
        if !webhook_url.is_empty() {
            body["webhook_url"] = json!(webhook_url);
        }
        self.submit_body(&body).await
    }

    /// Submits `body`, a whole `POST /v1/jobs` body (with `tags`,
    /// `priority`, `run_at`, … as the HTTP guide gives them).
    pub async fn submit_body<O: DeserializeOwned>(
        &self,
        body: &Value,
    ) -> Result<Submitted<O>, ClientError> {
        let response = self
            .request(reqwest::Method::POST, "/v1/jobs")
            .json(body)
            .send()
            .await?;
        let (status, job) = Self::answer(response).await?;
        Ok(Submitted {
            created: status == 201,
            job,
        })
    }

    /// Submits up to 1,000 `POST /v1/jobs` bodies in one request: one
    /// answer per job, in order (`{"status", "job"}` or `{"status", "error"}`),
    /// each what a single submit would have answered.
    pub async fn submit_batch(&self, jobs: &[Value]) -> Result<Vec<Value>, ClientError> {
        let response = self
            .request(reqwest::Method::POST, "/v1/jobs/batch")
            .json(&json!({ "jobs": jobs }))
            .send()
            .await?;
        let (_, answer): (u16, Value) = Self::answer(response).await?;
        Ok(answer["jobs"].as_array().cloned().unwrap_or_default())
    }

    /// A job with its history, result and last error.
    pub async fn job<O: DeserializeOwned>(&self, id: &str) -> Result<Job<O>, ClientError> {
        let response = self
            .request(reqwest::Method::GET, &format!("/v1/jobs/{}", encode(id)))
            .send()
            .await?;
        Ok(Self::answer(response).await?.1)
    }

    /// A job exactly as the API answers it (every field, as JSON).
    pub async fn job_json(&self, id: &str) -> Result<Value, ClientError> {
        self.job_value(id).await
    }

    async fn job_value(&self, id: &str) -> Result<Value, ClientError> {
        let response = self
            .request(reqwest::Method::GET, &format!("/v1/jobs/{}", encode(id)))
            .send()
            .await?;
        Ok(Self::answer(response).await?.1)
    }

    /// A page of jobs, newest first.
    pub async fn list(&self, query: &ListQuery) -> Result<Page, ClientError> {
        let mut params: Vec<(&str, String)> = Vec::new();
        if let Some(s) = query.state {
            params.push(("state", s.as_str().to_owned()));
        }
        if let Some(w) = &query.workflow {
            params.push(("workflow", w.clone()));
        }
        if let Some(l) = query.limit {
            params.push(("limit", l.to_string()));
        }
        if let Some(c) = &query.cursor {
            params.push(("cursor", c.clone()));
        }
        let query: String = params
            .iter()
            .map(|(k, v)| format!("{k}={}", encode(v)))
            .collect::<Vec<_>>()
            .join("&");
        let response = self
            .request(reqwest::Method::GET, &format!("/v1/jobs?{query}"))
            .send()
            .await?;
        Ok(Self::answer(response).await?.1)
    }

    /// Cancels a live job.
    pub async fn cancel(&self, id: &str, reason: &str) -> Result<Job, ClientError> {
        let response = self
            .request(
                reqwest::Method::POST,
                &format!("/v1/jobs/{}/cancel", encode(id)),
            )
            .json(&json!({ "reason": reason }))
            .send()
            .await?;
        Ok(Self::answer(response).await?.1)
    }

    /// Sends job `id` the signal `name` (its `ctx.wait_for_signal`, or an
    /// approval), recorded once under `signal_id`: `true` when recorded
    /// now, `false` when the identical signal was recorded before. The same
    /// id with another payload is `ClientError::Conflict` (`signal_conflict`),
    /// as is a finished job (`job_finished`).
    pub async fn signal(
        &self,
        id: &str,
        name: &str,
        signal_id: &str,
        payload: &Value,
    ) -> Result<bool, ClientError> {
        self.signal_for_wait(id, name, signal_id, payload, None)
            .await
    }

    /// [`signal`](Self::signal) for one wait: with `until` (the wait's
    /// `waiting.until`), recorded only while the job waits for `name` with
    /// that due time, else `ClientError::Conflict` (`not_waiting`), so a
    /// decision on a wait that is over is never kept for a later one.
    pub async fn signal_for_wait(
        &self,
        id: &str,
        name: &str,
        signal_id: &str,
        payload: &Value,
        until: Option<&str>,
    ) -> Result<bool, ClientError> {
        let mut body = json!({ "id": signal_id, "payload": payload });
        if let Some(until) = until {
            body["until"] = json!(until);
        }
        let response = self
            .request(
                reqwest::Method::POST,
                &format!("/v1/jobs/{}/signals/{}", encode(id), encode(name)),
            )
            .json(&body)
            .send()
            .await?;
        let (status, _): (u16, Value) = Self::answer(response).await?;
        Ok(status == 202)
    }

    /// Creates schedule `schedule` (the body of `POST /v1/schedules`:
    /// `{"id", "cron", "timezone"?, "workflow", "input", "webhook_url",
    /// "catch_up"?}`): `true` when created now, `false` when the identical
    /// schedule existed. Another schedule under its id is
    /// `ClientError::Conflict` (`schedule_conflict`).
    pub async fn create_schedule(&self, schedule: &Value) -> Result<(bool, Value), ClientError> {
        let response = self
            .request(reqwest::Method::POST, "/v1/schedules")
            .json(schedule)
            .send()
            .await?;
        let (status, view): (u16, Value) = Self::answer(response).await?;
        Ok((status == 201, view))
    }

    /// The caller's schedules (an admin token: all), by id, every page.
    pub async fn schedules(&self) -> Result<Vec<Value>, ClientError> {
        let mut all = Vec::new();
        let mut cursor: Option<String> = None;
        loop {
            let path = match &cursor {
                Some(c) => format!("/v1/schedules?cursor={}", encode(c)),
                None => "/v1/schedules".to_owned(),
            };
            let response = self.request(reqwest::Method::GET, &path).send().await?;
            let (_, page): (u16, Value) = Self::answer(response).await?;
            all.extend(page["schedules"].as_array().cloned().unwrap_or_default());
            match page["next_cursor"].as_str() {
                Some(next) => cursor = Some(next.to_owned()),
                None => return Ok(all),
            }
        }
    }

    /// Schedule `id`, with `next_fire_at` and its latest jobs.
    pub async fn schedule(&self, id: &str) -> Result<Value, ClientError> {
        let response = self
            .request(
                reqwest::Method::GET,
                &format!("/v1/schedules/{}", encode(id)),
            )
            .send()
            .await?;
        Ok(Self::answer(response).await?.1)
    }

    /// Deletes schedule `id` (its jobs stay).
    pub async fn delete_schedule(&self, id: &str) -> Result<(), ClientError> {
        let response = self
            .request(
                reqwest::Method::DELETE,
                &format!("/v1/schedules/{}", encode(id)),
            )
            .send()
            .await?;
        if response.status().as_u16() == 204 {
            return Ok(());
        }
        Self::answer::<Value>(response).await.map(|_| ())
    }

    /// Pauses (`true`) or resumes (`false`) schedule `id`; returns it.
    pub async fn pause_schedule(&self, id: &str, paused: bool) -> Result<Value, ClientError> {
        let action = if paused { "pause" } else { "resume" };
        let response = self
            .request(
                reqwest::Method::POST,
                &format!("/v1/schedules/{}/{action}", encode(id)),
            )
            .send()
            .await?;
        Ok(Self::answer(response).await?.1)
    }

    /// Redrives a dead job (an unknown delivery only with `confirm_unknown`).
    pub async fn redrive(
        &self,
        id: &str,
        reason: &str,
        confirm_unknown: bool,
    ) -> Result<Job, ClientError> {
        let confirm = if confirm_unknown {
            "?confirm_unknown=true"
        } else {
            ""
        };
        let response = self
            .request(
                reqwest::Method::POST,
                &format!("/v1/jobs/{}/redrive{confirm}", encode(id)),
            )
            .json(&json!({ "reason": reason }))
            .send()
            .await?;
        Ok(Self::answer(response).await?.1)
    }

    /// Cancels the caller's live jobs (an admin token: everyone's), oldest
    /// first, in `state` and of `workflow` when given, at most `limit`
    /// (1,000 by default), each as [`cancel`](Self::cancel) would: how many.
    pub async fn cancel_all(
        &self,
        state: Option<&str>,
        workflow: Option<&str>,
        limit: Option<u32>,
        reason: &str,
    ) -> Result<u64, ClientError> {
        let mut body = json!({ "reason": reason });
        if let Some(s) = state {
            body["state"] = json!(s);
        }
        if let Some(w) = workflow {
            body["workflow"] = json!(w);
        }
        if let Some(l) = limit {
            body["limit"] = json!(l);
        }
        let response = self
            .request(reqwest::Method::POST, "/v1/jobs/cancel")
            .json(&body)
            .send()
            .await?;
        let (_, counts): (u16, Value) = Self::answer(response).await?;
        Ok(counts["cancelled"].as_u64().unwrap_or(0))
    }

    /// Runs job `id`'s workflow again on its input (and webhook) as a new
    /// job `new_id`: `true` when created now, `false` when that rerun was
    /// made before. `new_id` holding another job is `ClientError::Conflict`.
    pub async fn rerun(&self, id: &str, new_id: &str) -> Result<(bool, Job), ClientError> {
        let response = self
            .request(
                reqwest::Method::POST,
                &format!("/v1/jobs/{}/rerun", encode(id)),
            )
            .json(&json!({ "id": new_id }))
            .send()
            .await?;
        let (status, job): (u16, Job) = Self::answer(response).await?;
        Ok((status == 201, job))
    }

    /// Redrives every dead job of the caller (an admin token: all), of
    /// `workflow` if given; returns how many resumed and how many were
    /// skipped for an unknown delivery.
    pub async fn redrive_all(
        &self,
        workflow: Option<&str>,
        reason: &str,
        confirm_unknown: bool,
    ) -> Result<(u64, u64), ClientError> {
        let confirm = if confirm_unknown {
            "?confirm_unknown=true"
        } else {
            ""
        };
        let mut body = json!({ "reason": reason });
        if let Some(w) = workflow {
            body["workflow"] = json!(w);
        }
        let response = self
            .request(reqwest::Method::POST, &format!("/v1/jobs/redrive{confirm}"))
            .json(&body)
            .send()
            .await?;
        let (_, counts): (u16, Value) = Self::answer(response).await?;
        Ok((
            counts["redriven"].as_u64().unwrap_or(0),
            counts["skipped_unknown"].as_u64().unwrap_or(0),
        ))
    }
}

/// Percent-encodes a query value.
fn encode(v: &str) -> String {
    v.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            other => format!("%{other:02X}"),
        })
        .collect()
}
