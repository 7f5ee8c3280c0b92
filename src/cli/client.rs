//! `onceflow submit` and `onceflow status`: clients of a running server.

use std::path::PathBuf;

use anyhow::{bail, Context as _};
use clap::Args;
use serde_json::{json, Value};

#[derive(Debug, Args)]
pub struct SubmitArgs {
    /// The job id (your business id: 1–200 of A-Z a-z 0-9 _ . : -).
    #[arg(long)]
    pub id: String,
    /// A single user prompt (for `completion` and `agent`).
    #[arg(
        long,
        conflicts_with_all = ["messages", "input"],
        required_unless_present_any = ["messages", "input"]
    )]
    pub prompt: Option<String>,
    /// A JSON file holding the `messages` array (for `completion` and `agent`).
    #[arg(long, conflicts_with = "input")]
    pub messages: Option<PathBuf>,
    /// The job's whole `input` as a JSON object, for any workflow
    /// (`--input '{"name": "Ada"}'`); `--model` is then not used.
    #[arg(long)]
    pub input: Option<String>,
    /// A tag, `label=value` (repeat for more): list and cancel jobs by it.
    #[arg(long = "tag", value_name = "LABEL=VALUE")]
    pub tags: Vec<String>,
    /// A key of yours (a customer, a conversation): at most the token's
    /// (or the workflow's) limit of jobs with it run at once, 1 by default.
    #[arg(long)]
    pub concurrency_key: Option<String>,
    /// Where the completion webhook goes; without it the job POSTs
    /// nothing (follow it with `status` or `watch`).
    #[arg(long, default_value = "")]
    pub webhook_url: String,
    /// The model name sent to the provider.
    #[arg(long, default_value = "gpt-4o-mini")]
    pub model: String,
    /// The workflow to run.
    #[arg(long, default_value = "completion")]
    pub workflow: String,
    /// The onceflow server.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub server: String,
    /// The API token (sent as `Authorization: Bearer …`, never in a URL).
    /// Prefer ONCEFLOW_TOKEN: a flag's value is visible in `ps`.
    #[arg(long, env = "ONCEFLOW_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
}

#[derive(Debug, Args)]
pub struct StatusArgs {
    /// The job id.
    pub id: String,
    /// The onceflow server.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub server: String,
    /// Print the raw JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// The API token (sent as `Authorization: Bearer …`, never in a URL).
    /// Prefer ONCEFLOW_TOKEN: a flag's value is visible in `ps`.
    #[arg(long, env = "ONCEFLOW_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
}

/// Adds the bearer token, when there is one.
fn with_token(request: reqwest::RequestBuilder, token: Option<&str>) -> reqwest::RequestBuilder {
    match token {
        Some(t) => request.bearer_auth(t),
        None => request,
    }
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}

/// Turns an API error body into a readable message.
fn api_error(status: reqwest::StatusCode, body: &Value) -> anyhow::Error {
    let e = &body["error"];
    let field = e["field"]
        .as_str()
        .map(|f| format!(" (field: {f})"))
        .unwrap_or_default();
    anyhow::anyhow!(
        "server answered {status}: {}{field}",
        e["message"].as_str().unwrap_or("no message")
    )
}

pub fn submit(args: SubmitArgs) -> anyhow::Result<()> {
    let messages = match (&args.prompt, &args.messages) {
        _ if args.input.is_some() => Value::Null,
        (Some(prompt), _) => json!([{ "role": "user", "content": prompt }]),
        (None, Some(path)) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            let value: Value = serde_json::from_str(&text)
                .with_context(|| format!("{} is not JSON", path.display()))?;
            if !value.is_array() {
                bail!("{} must hold a JSON array of messages", path.display());
            }
            value
        }
        (None, None) => bail!("give --prompt, --messages or --input"),
    };
    let input = match &args.input {
        Some(text) => {
            let input: Value = serde_json::from_str(text).context("--input is not JSON")?;
            if !input.is_object() {
                bail!("--input must be a JSON object (the workflow's input)");
            }
            input
        }
        None => json!({ "model": args.model, "messages": messages }),
    };
    let mut body = json!({ "id": args.id, "workflow": args.workflow, "input": input });
    if !args.webhook_url.is_empty() {
        body["webhook_url"] = json!(args.webhook_url);
    }
    if let Some(key) = &args.concurrency_key {
        body["concurrency_key"] = json!(key);
    }
    if !args.tags.is_empty() {
        let mut tags = serde_json::Map::new();
        for tag in &args.tags {
            let Some((label, value)) = tag.split_once('=') else {
                bail!("--tag {tag:?} must be label=value");
            };
            tags.insert(label.to_owned(), json!(value));
        }
        body["tags"] = Value::Object(tags);
    }
    let client = api(&args.server, args.token.as_deref());
    runtime()?.block_on(async {
        let submitted = client
            .submit_body::<Value>(&body)
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let verb = if submitted.created {
            "created"
        } else {
            "already submitted (identical)"
        };
        println!(
            "job {} {verb}: state {}",
            submitted.job.id, submitted.job.state
        );
        let view = client
            .job_json(&args.id)
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        println!("{}", serde_json::to_string_pretty(&view)?);
        Ok(())
    })
}

/// The typed client for `server`, with `token` when given.
fn api(server: &str, token: Option<&str>) -> crate::Client {
    let client = crate::Client::new(server);
    match token {
        Some(t) => client.with_token(t),
        None => client,
    }
}

pub fn status(args: StatusArgs) -> anyhow::Result<()> {
    let client = api(&args.server, args.token.as_deref());
    runtime()?.block_on(async {
        let job = client
            .job_json(&args.id)
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        if args.json {
            println!("{}", serde_json::to_string_pretty(&job)?);
        } else {
            print!("{}", render_status(&job));
        }
        Ok(())
    })
}

/// The job as a readable table.
pub fn render_status(job: &Value) -> String {
    let s = |v: &Value| {
        v.as_str()
            .map(str::to_owned)
            .unwrap_or_else(|| v.to_string())
    };
    let mut out = format!(
        "job       {}\nworkflow  {} v{}\nstate     {}\nattempts  {}\n",
        s(&job["id"]),
        s(&job["workflow"]),
        job["workflow_version"],
        s(&job["state"]),
        job["attempts"]
    );
    if let Some(reason) = job["dead_reason"].as_str() {
        out.push_str(&format!("dead      {reason}\n"));
    }
    if let Some(err) = job["last_error"].as_object() {
        out.push_str(&format!(
            "error     {}: {}\n",
            s(&err["code"]),
            s(&err["message"])
        ));
    }
    if let Some(d) = job["delivery"].as_object() {
        out.push_str(&format!(
            "delivery  {} ({} attempts, key {})\n",
            s(&d["status"]),
            d["attempts"],
            s(&d["idempotency_key"])
        ));
    }
    out.push_str("\n  #  state      attempt  worker                          at\n");
    for (i, h) in job["history"].as_array().into_iter().flatten().enumerate() {
        out.push_str(&format!(
            "{:>3}  {:<10} {:>7}  {:<30}  {}\n",
            i + 1,
            s(&h["state"]),
            h["attempt"],
            s(&h["worker"]),
            s(&h["at"])
        ));
    }
    out
}

#[derive(Debug, Args)]
pub struct JobsArgs {
    /// Only jobs in this state (received, …, acked, dead).
    #[arg(long)]
    pub state: Option<String>,
    /// Only jobs of this workflow.
    #[arg(long)]
    pub workflow: Option<String>,
    /// How many (1–500).
    #[arg(long, default_value_t = 50)]
    pub limit: u32,
    /// Continue after a previous page (its `next_cursor`).
    #[arg(long)]
    pub cursor: Option<String>,
    /// Print the raw JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// The onceflow server.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub server: String,
    /// The API token (sent as `Authorization: Bearer …`, never in a URL).
    /// Prefer ONCEFLOW_TOKEN: a flag's value is visible in `ps`.
    #[arg(long, env = "ONCEFLOW_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
}

/// `onceflow jobs`: one page of jobs, newest first.
pub fn jobs(args: JobsArgs) -> anyhow::Result<()> {
    let url = format!("{}/v1/jobs", args.server.trim_end_matches('/'));
    let mut query: Vec<(&str, String)> = vec![("limit", args.limit.to_string())];
    if let Some(s) = &args.state {
        query.push(("state", s.clone()));
    }
    if let Some(w) = &args.workflow {
        query.push(("workflow", w.clone()));
    }
    if let Some(c) = &args.cursor {
        query.push(("cursor", c.clone()));
    }
    let encode = |v: &str| {
        v.bytes()
            .map(|b| match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                    (b as char).to_string()
                }
                other => format!("%{other:02X}"),
            })
            .collect::<String>()
    };
    let url = format!(
        "{url}?{}",
        query
            .iter()
            .map(|(k, v)| format!("{k}={}", encode(v)))
            .collect::<Vec<_>>()
            .join("&")
    );
    runtime()?.block_on(async {
        let response = with_token(reqwest::Client::new().get(&url), args.token.as_deref())
            .send()
            .await
            .with_context(|| format!("cannot reach the onceflow server at {}", args.server))?;
        let status = response.status();
        let page: Value = response
            .json()
            .await
            .context("the server's answer is not JSON")?;
        if !status.is_success() {
            return Err(api_error(status, &page));
        }
        if args.json {
            println!("{}", serde_json::to_string_pretty(&page)?);
            return Ok(());
        }
        println!(
            "{:<40} {:<20} {:<10} {:>8}  {:<25}  reason",
            "id", "workflow", "state", "attempts", "created"
        );
        for j in page["jobs"].as_array().into_iter().flatten() {
            println!(
                "{:<40} {:<20} {:<10} {:>8}  {:<25}  {}",
                j["id"].as_str().unwrap_or_default(),
                format!(
                    "{} v{}",
                    j["workflow"].as_str().unwrap_or_default(),
                    j["workflow_version"]
                ),
                j["state"].as_str().unwrap_or_default(),
                j["attempts"],
                j["created_at"].as_str().unwrap_or_default(),
                j["dead_reason"].as_str().unwrap_or_default()
            );
        }
        if let Some(next) = page["next_cursor"].as_str() {
            println!("\nmore: onceflow jobs --cursor {next}");
        }
        Ok(())
    })
}

#[derive(Debug, Args)]
pub struct CancelArgs {
    /// The job to cancel (or --all).
    #[arg(required_unless_present = "all", conflicts_with = "all")]
    pub id: Option<String>,
    /// Every live job (yours; an admin token: everyone's), oldest first.
    #[arg(long)]
    pub all: bool,
    /// With --all: only jobs in this live state.
    #[arg(long, requires = "all")]
    pub state: Option<String>,
    /// With --all: only this workflow's.
    #[arg(long, requires = "all")]
    pub workflow: Option<String>,
    /// With --all: at most this many (1–1,000, default 1,000).
    #[arg(long, requires = "all")]
    pub limit: Option<u32>,
    /// Why (kept in the job's history).
    #[arg(long, default_value = "cancelled from the CLI")]
    pub reason: String,
    /// The onceflow server.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub server: String,
    /// The API token (sent as `Authorization: Bearer …`, never in a URL).
    /// Prefer ONCEFLOW_TOKEN: a flag's value is visible in `ps`.
    #[arg(long, env = "ONCEFLOW_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
}

#[derive(Debug, Args)]
pub struct SignalArgs {
    /// The job id.
    pub job: String,
    /// The signal's name (what the job's wait asks for, e.g. `approval:call_1`).
    pub name: String,
    /// The signal's id: sending the same id again is the same signal.
    #[arg(long)]
    pub id: String,
    /// The payload, as JSON.
    #[arg(long, default_value = "null")]
    pub payload: String,
    /// Only for the wait due at this time (its `waiting.until`): refused
    /// (`not_waiting`) once that wait is over.
    #[arg(long)]
    pub until: Option<String>,
    /// The onceflow server.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub server: String,
    /// The API token (sent as `Authorization: Bearer …`, never in a URL).
    /// Prefer ONCEFLOW_TOKEN: a flag's value is visible in `ps`.
    #[arg(long, env = "ONCEFLOW_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
}

/// `onceflow signal JOB NAME --id ID --payload JSON`.
pub fn signal(args: SignalArgs) -> anyhow::Result<()> {
    let payload: Value = serde_json::from_str(&args.payload)
        .map_err(|e| anyhow::anyhow!("--payload is not JSON: {e}"))?;
    let client = api(&args.server, args.token.as_deref());
    runtime()?.block_on(async {
        let recorded = client
            .signal_for_wait(
                &args.job,
                &args.name,
                &args.id,
                &payload,
                args.until.as_deref(),
            )
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        if recorded {
            println!(
                "signal {} of {:?} recorded for job {}",
                args.id, args.name, args.job
            );
        } else {
            println!(
                "signal {} of {:?} was already recorded for job {}",
                args.id, args.name, args.job
            );
        }
        Ok(())
    })
}

#[derive(Debug, Args)]
pub struct ScheduleArgs {
    #[command(subcommand)]
    pub command: ScheduleCommand,
    /// The onceflow server.
    #[arg(long, global = true, default_value = "http://127.0.0.1:8080")]
    pub server: String,
    /// The API token (sent as `Authorization: Bearer …`, never in a URL).
    /// Prefer ONCEFLOW_TOKEN: a flag's value is visible in `ps`.
    #[arg(long, global = true, env = "ONCEFLOW_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
}

#[derive(Debug, clap::Subcommand)]
pub enum ScheduleCommand {
    /// Create a schedule: a cron that creates a job at each fire time
    /// (`{id}:{YYYYMMDDTHHMMSSZ}`).
    Create {
        /// The schedule's id (1–150 of A-Z a-z 0-9 _ . -).
        #[arg(long)]
        id: String,
        /// Five fields (minute hour day-of-month month day-of-week), or six with seconds first.
        #[arg(long)]
        cron: String,
        /// An IANA time zone (default UTC).
        #[arg(long)]
        timezone: Option<String>,
        /// The workflow each job runs.
        #[arg(long)]
        workflow: String,
        /// Each job's input, as a JSON object.
        #[arg(long)]
        input: String,
        /// Each job's webhook.
        #[arg(long)]
        webhook_url: String,
        /// Fire times missed while no node ran: latest (default), all or none.
        #[arg(long)]
        catch_up: Option<String>,
    },
    /// List your schedules with their next fire time.
    List,
    /// Show a schedule and its latest jobs.
    Show {
        /// The schedule's id.
        id: String,
    },
    /// Delete a schedule (its jobs stay).
    Delete {
        /// The schedule's id.
        id: String,
    },
    /// Pause a schedule: nothing fires until it is resumed.
    Pause {
        /// The schedule's id.
        id: String,
    },
    /// Resume a paused schedule from its next fire time.
    Resume {
        /// The schedule's id.
        id: String,
    },
}

/// `onceflow schedule create|list|show|delete|pause|resume`.
pub fn schedule(args: ScheduleArgs) -> anyhow::Result<()> {
    let client = api(&args.server, args.token.as_deref());
    let line = |s: &Value| {
        println!(
            "{:<24} {:<16} {:<10} {:<12} {}",
            s["id"].as_str().unwrap_or_default(),
            s["cron"].as_str().unwrap_or_default(),
            s["timezone"].as_str().unwrap_or_default(),
            s["workflow"].as_str().unwrap_or_default(),
            s["next_fire_at"].as_str().unwrap_or("paused"),
        )
    };
    runtime()?.block_on(async {
        let fail = |e: crate::ClientError| anyhow::anyhow!("{e}");
        match args.command {
            ScheduleCommand::Create {
                id,
                cron,
                timezone,
                workflow,
                input,
                webhook_url,
                catch_up,
            } => {
                let input: Value = serde_json::from_str(&input)
                    .map_err(|e| anyhow::anyhow!("--input is not JSON: {e}"))?;
                let mut body = json!({ "id": id, "cron": cron, "workflow": workflow,
                                       "input": input, "webhook_url": webhook_url });
                if let Some(tz) = timezone {
                    body["timezone"] = json!(tz);
                }
                if let Some(c) = catch_up {
                    body["catch_up"] = json!(c);
                }
                let (created, view) = client.create_schedule(&body).await.map_err(fail)?;
                println!(
                    "schedule {} {}; next fire at {}",
                    view["id"].as_str().unwrap_or_default(),
                    if created {
                        "created"
                    } else {
                        "already existed, unchanged"
                    },
                    view["next_fire_at"].as_str().unwrap_or("-")
                );
            }
            ScheduleCommand::List => {
                println!(
                    "{:<24} {:<16} {:<10} {:<12} NEXT FIRE",
                    "ID", "CRON", "TIMEZONE", "WORKFLOW"
                );
                for s in client.schedules().await.map_err(fail)? {
                    line(&s);
                }
            }
            ScheduleCommand::Show { id } => {
                let s = client.schedule(&id).await.map_err(fail)?;
                line(&s);
                for job in s["latest_jobs"].as_array().into_iter().flatten() {
                    println!(
                        "  {:<40} {}",
                        job["id"].as_str().unwrap_or_default(),
                        job["state"].as_str().unwrap_or("purged")
                    );
                }
            }
            ScheduleCommand::Delete { id } => {
                client.delete_schedule(&id).await.map_err(fail)?;
                println!("schedule {id} deleted; nothing fires after this");
            }
            ScheduleCommand::Pause { id } => {
                client.pause_schedule(&id, true).await.map_err(fail)?;
                println!("schedule {id} paused");
            }
            ScheduleCommand::Resume { id } => {
                let s = client.pause_schedule(&id, false).await.map_err(fail)?;
                println!(
                    "schedule {id} resumed; next fire at {}",
                    s["next_fire_at"].as_str().unwrap_or("-")
                );
            }
        }
        Ok(())
    })
}

#[derive(Debug, Args)]
pub struct RedriveArgs {
    /// The dead job to resume (or --all-dead).
    #[arg(required_unless_present = "all_dead", conflicts_with = "all_dead")]
    pub id: Option<String>,
    /// Every dead job (yours; an admin token: everyone's), oldest death first.
    #[arg(long)]
    pub all_dead: bool,
    /// With --all-dead: only this workflow's.
    #[arg(long, requires = "all_dead")]
    pub workflow: Option<String>,
    /// Why (kept in each job's history).
    #[arg(long)]
    pub reason: String,
    /// Also re-send webhooks whose outcome is unknown (at-most-once), under the same webhook-id.
    #[arg(long)]
    pub confirm_unknown: bool,
    /// The onceflow server.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub server: String,
    /// The API token (sent as `Authorization: Bearer …`, never in a URL).
    /// Prefer ONCEFLOW_TOKEN: a flag's value is visible in `ps`.
    #[arg(long, env = "ONCEFLOW_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
}

#[derive(Debug, Args)]
pub struct BatchArgs {
    /// A JSON file holding an array of `POST /v1/jobs` bodies (at most 1,000).
    pub file: PathBuf,
    /// The onceflow server.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub server: String,
    /// The API token (sent as `Authorization: Bearer …`, never in a URL).
    /// Prefer ONCEFLOW_TOKEN: a flag's value is visible in `ps`.
    #[arg(long, env = "ONCEFLOW_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
}

/// `onceflow batch FILE`: one line per job, in order, with what the server
/// answered it; exits non-zero when any job was refused.
pub fn batch(args: BatchArgs) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(&args.file)
        .with_context(|| format!("reading {}", args.file.display()))?;
    let jobs: Vec<Value> = serde_json::from_str(&text)
        .with_context(|| format!("{} must hold a JSON array of jobs", args.file.display()))?;
    let client = api(&args.server, args.token.as_deref());
    runtime()?.block_on(async {
        let answers = client
            .submit_batch(&jobs)
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let mut refused = 0;
        for (job, answer) in jobs.iter().zip(&answers) {
            let id = job["id"].as_str().unwrap_or("?");
            let status = answer["status"].as_u64().unwrap_or(0);
            match answer["error"]["code"].as_str() {
                Some(code) => {
                    refused += 1;
                    println!(
                        "{id}: {status} {code}: {}",
                        answer["error"]["message"].as_str().unwrap_or("")
                    );
                }
                None => println!(
                    "{id}: {status} {}",
                    answer["job"]["state"].as_str().unwrap_or("")
                ),
            }
        }
        if refused > 0 {
            bail!("{refused} of {} jobs were refused", answers.len());
        }
        Ok(())
    })
}

/// `onceflow cancel ID | --all`.
pub fn cancel(args: CancelArgs) -> anyhow::Result<()> {
    let client = api(&args.server, args.token.as_deref());
    runtime()?.block_on(async {
        match &args.id {
            Some(id) => {
                let job = client
                    .cancel(id, &args.reason)
                    .await
                    .map_err(|e| anyhow::anyhow!("{e}"))?;
                println!("job {} is {}", job.id, job.state);
            }
            None => {
                let n = client
                    .cancel_all(
                        args.state.as_deref(),
                        args.workflow.as_deref(),
                        args.limit,
                        &args.reason,
                    )
                    .await
                    .map_err(|e| anyhow::anyhow!("{e}"))?;
                println!("cancelled: {n}");
            }
        }
        Ok(())
    })
}

#[derive(Debug, Args)]
pub struct RerunArgs {
    /// The job whose workflow and input run again.
    pub id: String,
    /// The new job's id (running this again with the same id is the same rerun).
    #[arg(long = "as")]
    pub new_id: String,
    /// The onceflow server.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub server: String,
    /// The API token (sent as `Authorization: Bearer …`, never in a URL).
    /// Prefer ONCEFLOW_TOKEN: a flag's value is visible in `ps`.
    #[arg(long, env = "ONCEFLOW_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
}

/// `onceflow rerun ID --as NEW_ID`.
pub fn rerun(args: RerunArgs) -> anyhow::Result<()> {
    let client = api(&args.server, args.token.as_deref());
    runtime()?.block_on(async {
        let (created, job) = client
            .rerun(&args.id, &args.new_id)
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let verb = if created {
            "created"
        } else {
            "already existed"
        };
        println!(
            "job {} {verb} ({}), a rerun of {}",
            job.id, job.state, args.id
        );
        Ok(())
    })
}

/// `onceflow redrive ID | --all-dead`.
pub fn redrive(args: RedriveArgs) -> anyhow::Result<()> {
    let client = api(&args.server, args.token.as_deref());
    runtime()?.block_on(async {
        match &args.id {
            Some(id) => {
                let job = client
                    .redrive(id, &args.reason, args.confirm_unknown)
                    .await
                    .map_err(|e| anyhow::anyhow!("{e}"))?;
                println!("job {id} resumes at {}", job.state);
            }
            None => {
                let (redriven, skipped) = client
                    .redrive_all(args.workflow.as_deref(), &args.reason, args.confirm_unknown)
                    .await
                    .map_err(|e| anyhow::anyhow!("{e}"))?;
                println!(
                    "redriven: {redriven}, skipped (a delivery or tool call unknown, needs --confirm-unknown): {skipped}"
                );
            }
        }
        Ok(())
    })
}

#[derive(Debug, Args)]
pub struct WatchArgs {
    /// The job id.
    pub id: String,
    /// The onceflow server.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub server: String,
    /// Print every event as a JSON line instead of the text as it comes.
    #[arg(long)]
    pub json: bool,
    /// The API token (sent as `Authorization: Bearer …`, never in a URL).
    /// Prefer ONCEFLOW_TOKEN: a flag's value is visible in `ps`.
    #[arg(long, env = "ONCEFLOW_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
}

/// `onceflow watch ID`: the job's streamed answer on stdout as it is
/// journaled, its state changes and resets on stderr; a dropped connection
/// is resumed from the last event seen (`Last-Event-ID`), so nothing is
/// printed twice. Ends with the job's final state: success when acked.
pub fn watch(args: WatchArgs) -> anyhow::Result<()> {
    use std::io::Write;
    let url = format!(
        "{}/v1/jobs/{}/events",
        args.server.trim_end_matches('/'),
        args.id
    );
    runtime()?.block_on(async {
        let http = reqwest::Client::new();
        let mut last: Option<i64> = None;
        let mut shown_call: Option<String> = None;
        let mut final_state: Option<String> = None;
        let mut failures = 0u32;
        while final_state.is_none() {
            let mut request = with_token(http.get(&url), args.token.as_deref());
            if let Some(last) = last {
                request = request.header("last-event-id", last.to_string());
            }
            let mut response = match request.send().await {
                Ok(r) if r.status().is_success() => r,
                Ok(r) => {
                    let status = r.status();
                    let body: Value = r.json().await.unwrap_or(Value::Null);
                    return Err(api_error(status, &body));
                }
                Err(e) if failures < 30 => {
                    failures += 1;
                    eprintln!("[connection failed: {e}; retrying]");
                    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                    continue;
                }
                Err(e) => return Err(anyhow::anyhow!("cannot reach {}: {e}", args.server)),
            };
            failures = 0;
            // Bytes, not text: a character may be split across two reads.
            let mut buffer: Vec<u8> = Vec::new();
            loop {
                let chunk = match response.chunk().await {
                    Ok(Some(chunk)) => chunk,
                    Ok(None) => break,
                    Err(e) => {
                        eprintln!("\n[connection lost: {e}; resuming]");
                        break;
                    }
                };
                buffer.extend_from_slice(&chunk);
                while let Some(end) = buffer.windows(2).position(|w| w == b"\n\n") {
                    let bytes: Vec<u8> = buffer.drain(..end + 2).collect();
                    let frame = String::from_utf8_lossy(&bytes);
                    let Some(data) = frame.lines().find_map(|l| l.strip_prefix("data: ")) else {
                        continue; // a keep-alive comment
                    };
                    let event: Value = serde_json::from_str(data).with_context(|| {
                        format!("the server sent an event that is not JSON: {data}")
                    })?;
                    last = event["id"].as_i64().or(last);
                    let text = event["text"].as_str().unwrap_or_default();
                    if args.json {
                        println!("{event}");
                    } else {
                        match event["kind"].as_str() {
                            Some("chunk") => {
                                // An agent streams each turn under its own key.
                                let call = event["call"].as_str().map(str::to_owned);
                                if shown_call.is_some() && shown_call != call {
                                    println!();
                                }
                                shown_call = call;
                                print!("{text}");
                                std::io::stdout().flush()?;
                            }
                            Some("reset") => eprintln!("\n[reset: {text}]"),
                            _ => eprintln!("[{text}]"),
                        }
                    }
                    if event["kind"] == "state" && matches!(text, "acked" | "dead" | "cancelled") {
                        final_state = Some(text.to_owned());
                    }
                }
            }
            if final_state.is_none() {
                if last.is_none() {
                    // The server ended a stream that never started.
                    bail!("the event stream of {} ended before any event", args.id);
                }
                // The server ends a finished job's stream; a resumed stream
                // past its end is empty: ask the job its state.
                let job = api(&args.server, args.token.as_deref())
                    .job_json(&args.id)
                    .await
                    .map_err(|e| anyhow::anyhow!("{e}"))?;
                if let Some(state) = job["state"]
                    .as_str()
                    .filter(|s| matches!(*s, "acked" | "dead" | "cancelled"))
                {
                    final_state = Some(state.to_owned());
                }
            }
        }
        if !args.json {
            println!();
        }
        match final_state.as_deref() {
            Some("acked") => Ok(()),
            Some(other) => bail!("job {} ended {other}", args.id),
            None => unreachable!("the loop ends with a final state"),
        }
    })
}
