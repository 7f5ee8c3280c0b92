//! Flags and environment variables (each flag has its env name; see
//! docs/guide/operations.md, "Configuration").

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::Args;
use onceflow_engine::pg::EmbeddedPg;
use onceflow_engine::{db, Db};

/// A value that must not show up in logs: `Debug` prints `[redacted]`.
#[derive(Clone)]
pub struct Secret(String);

impl Secret {
    /// The value itself, for where it must go (a connection, a header).
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("[redacted]")
    }
}

impl std::str::FromStr for Secret {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Secret(s.to_owned()))
    }
}

/// Where the database is.
#[derive(Debug, Clone, Args)]
pub struct DbArgs {
    /// PostgreSQL URL; unset: an embedded server in $ONCEFLOW_DATA_DIR/pg.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<Secret>,
    /// Where the embedded PostgreSQL keeps its data.
    #[arg(long, env = "ONCEFLOW_DATA_DIR", default_value = "./.onceflow")]
    pub data_dir: PathBuf,
    /// Largest number of pooled database connections.
    #[arg(long, env = "ONCEFLOW_DB_POOL", default_value_t = 16)]
    pub db_pool: u32,
}

/// `onceflow serve`.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Where the database is.
    #[command(flatten)]
    pub db: DbArgs,
    /// HTTP API address.
    #[arg(long, env = "ONCEFLOW_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// OpenAI-compatible provider base URL.
    #[arg(
        long,
        env = "OPENAI_BASE_URL",
        default_value = "https://api.openai.com/v1"
    )]
    pub openai_base_url: String,
    /// Provider API key (sent as a bearer token).
    #[arg(long, env = "OPENAI_API_KEY", hide_env_values = true)]
    pub openai_api_key: Option<Secret>,
    /// Provider limits shared by every node: JSON
    /// `{"<model>" | "<provider>/<model>" | "*": {"concurrency": N, "rpm": N, "tpm": N}}`, or
    /// `@path` to a file holding it.
    #[arg(long, env = "ONCEFLOW_LIMITS")]
    pub limits: Option<String>,
    /// Anthropic Messages API base URL (jobs with `"provider": "anthropic"`).
    #[arg(
        long,
        env = "ANTHROPIC_BASE_URL",
        default_value = "https://api.anthropic.com"
    )]
    pub anthropic_base_url: String,
    /// Anthropic API key (sent as `x-api-key`).
    #[arg(long, env = "ANTHROPIC_API_KEY", hide_env_values = true)]
    pub anthropic_api_key: Option<Secret>,
    /// Speak HTTP/2 without TLS (h2c, prior knowledge) to a plain-http
    /// provider or gateway that supports it; HTTPS providers negotiate HTTP/2 by themselves.
    #[arg(long, env = "ONCEFLOW_PROVIDER_H2C")]
    pub provider_h2c: bool,
    /// Standard Webhooks signing secret (`whsec_…`); unset: webhooks are unsigned.
    #[arg(long, env = "ONCEFLOW_WEBHOOK_SECRET", hide_env_values = true)]
    pub webhook_secret: Option<Secret>,
    /// Lease (visibility timeout) length in milliseconds.
    #[arg(long, env = "ONCEFLOW_LEASE_MS", default_value_t = 30_000)]
    pub lease_ms: u64,
    /// Largest accepted request body in bytes.
    #[arg(long, env = "ONCEFLOW_BODY_LIMIT", default_value_t = onceflow_engine::api::DEFAULT_BODY_LIMIT)]
    pub body_limit: usize,
    /// Jobs this node runs at once.
    #[arg(long, env = "ONCEFLOW_MAX_IN_FLIGHT", default_value_t = 1000)]
    pub max_in_flight: usize,
    /// How often to look for work without a NOTIFY, in milliseconds.
    #[arg(long, env = "ONCEFLOW_POLL_MS", default_value_t = 1000)]
    pub poll_ms: u64,
    /// Timeout of one model request, in milliseconds.
    #[arg(long, env = "ONCEFLOW_MODEL_TIMEOUT_MS", default_value_t = 120_000)]
    pub model_timeout_ms: u64,
    /// Timeout of one webhook request, in milliseconds.
    #[arg(long, env = "ONCEFLOW_WEBHOOK_TIMEOUT_MS", default_value_t = 10_000)]
    pub webhook_timeout_ms: u64,
    /// First retry backoff (upper bound of the jitter), in milliseconds.
    #[arg(long, env = "ONCEFLOW_RETRY_BASE_MS")]
    pub retry_base_ms: Option<u64>,
    /// This node's name (lease owner); default host:pid.
    #[arg(long, env = "ONCEFLOW_NODE_ID")]
    pub node_id: Option<String>,
    /// How long finished jobs and their keys are kept (e.g. 24h, 30m, 90s, 7d).
    #[arg(long, env = "ONCEFLOW_RETENTION", default_value = "24h", value_parser = parse_duration)]
    pub retention: Duration,
    /// The web console's link to a job's trace, with `{trace_id}` (e.g.
    /// `http://localhost:16686/trace/{trace_id}` for Jaeger).
    #[arg(long, env = "ONCEFLOW_TRACE_URL")]
    pub trace_url: Option<String>,
    /// How long dead jobs are kept for a redrive (e.g. 7d).
    #[arg(long, env = "ONCEFLOW_DEAD_RETENTION", default_value = "7d", value_parser = parse_duration)]
    pub dead_retention: Duration,
    /// Every workflow sends `job.dead` / `job.cancelled` webhooks when its jobs fail or are cancelled.
    #[arg(long, env = "ONCEFLOW_FAILURE_EVENTS")]
    pub failure_events: bool,
    /// Where the agent's built-in `http_post` tool posts; unset: the agent has no tools.
    #[arg(long, env = "ONCEFLOW_TOOL_POST_URL")]
    pub tool_post_url: Option<String>,
    /// MCP servers whose tools agent jobs may use: JSON, or `@path` to a
    /// JSON file, of `{"<server>": {"url": "http(s)://…", "headers"?: {…}}}`;
    /// a header's value is a string, `{"env": "VAR"}` or `{"file": "path"}`
    /// (give secrets the last two ways). On the command line only as `@path`.
    #[arg(long, env = "ONCEFLOW_MCP_SERVERS", hide_env_values = true)]
    pub mcp_servers: Option<String>,
    /// HTTP worker threads.
    #[arg(long, env = "ONCEFLOW_HTTP_WORKERS", default_value_t = 2)]
    pub http_workers: usize,
    /// Let webhooks and tools reach loopback, private and link-local
    /// addresses. For local development and tests only: it turns the SSRF
    /// guard off.
    #[arg(long, env = "ONCEFLOW_ALLOW_PRIVATE_URLS")]
    pub allow_private_urls: bool,
    /// Extra `Host` names the API answers (comma-separated, `name` or
    /// `name:port`), besides the listen address and, on loopback,
    /// `localhost:<port>`: what a load balancer or DNS name in front sends.
    #[arg(long, env = "ONCEFLOW_ALLOWED_HOSTS", value_delimiter = ',')]
    pub allowed_hosts: Vec<String>,
    /// On SIGTERM/SIGINT, how long requests in flight get to finish and be
    /// recorded before the node hands its jobs over (e.g. 10s, 1m).
    #[arg(long, env = "ONCEFLOW_DRAIN_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub drain_timeout: Duration,
    /// Unfinished jobs above which intake answers 429 with Retry-After.
    #[arg(long, env = "ONCEFLOW_MAX_BACKLOG", default_value_t = 100_000)]
    pub max_backlog: u64,
    /// The same bound per API token.
    #[arg(long, env = "ONCEFLOW_MAX_BACKLOG_PER_TOKEN", default_value_t = 10_000)]
    pub max_backlog_per_token: u64,
    /// The shortest time between two fire times of a schedule a token (not
    /// admin) creates (e.g. 60s, 1m).
    #[arg(long, env = "ONCEFLOW_MIN_SCHEDULE_INTERVAL", default_value = "60s", value_parser = parse_duration)]
    pub min_schedule_interval: Duration,
    /// Event streams (`GET /v1/jobs/{id}/events`) open at once on this node.
    #[arg(long, env = "ONCEFLOW_MAX_STREAMS", default_value_t = 1_000)]
    pub max_streams: usize,
    /// The same bound per API token.
    #[arg(long, env = "ONCEFLOW_MAX_STREAMS_PER_TOKEN", default_value_t = 100)]
    pub max_streams_per_token: usize,
    /// Bytes of job intake bodies (submits and batches) this node holds at
    /// once, from before they are read until they are answered; a request
    /// past it is `429 busy` with `Retry-After` (at least one batch's
    /// 16 × `ONCEFLOW_BODY_LIMIT`).
    #[arg(long, env = "ONCEFLOW_MAX_BODY_BYTES_IN_FLIGHT", default_value_t = 64 << 20)]
    pub max_body_bytes_in_flight: usize,
    /// The same bound per API token (development mode and admin tokens
    /// count as one).
    #[arg(long, env = "ONCEFLOW_MAX_BODY_BYTES_PER_TOKEN", default_value_t = 32 << 20)]
    pub max_body_bytes_per_token: usize,
}

impl ServeArgs {
    /// The engine's configuration these flags describe.
    pub fn engine_config(&self) -> anyhow::Result<onceflow_engine::EngineConfig> {
        let mut config = onceflow_engine::EngineConfig {
            lease: Duration::from_millis(self.lease_ms.max(100)),
            poll_interval: Duration::from_millis(self.poll_ms.max(10)),
            max_in_flight: self.max_in_flight.max(1),
            webhook_timeout: Duration::from_millis(self.webhook_timeout_ms),
            retention: self.retention,
            dead_retention: self.dead_retention,
            max_backlog_per_token: Some(self.max_backlog_per_token),
            url_guard: if self.allow_private_urls {
                onceflow_engine::UrlGuard::allow_private()
            } else {
                onceflow_engine::UrlGuard::strict()
            },
            webhook_secret: self
                .webhook_secret
                .as_ref()
                .map(Secret::expose)
                .map(str::parse)
                .transpose()
                .context("ONCEFLOW_WEBHOOK_SECRET")?,
            ..Default::default()
        };
        if let Some(node) = &self.node_id {
            config.node_id = node.clone();
        }
        config.provider.base_url = self.openai_base_url.clone();
        config.provider.api_key = self.openai_api_key.as_ref().map(|k| k.expose().to_owned());
        config.provider.h2c = self.provider_h2c;
        if let Some(limits) = &self.limits {
            let text = match limits.strip_prefix('@') {
                Some(path) => std::fs::read_to_string(path)
                    .with_context(|| format!("ONCEFLOW_LIMITS: reading {path}"))?,
                None => limits.clone(),
            };
            config.limits =
                onceflow_engine::rules::quota::Limits::parse(&text).map_err(anyhow::Error::msg)?;
        }
        config.provider.anthropic_base_url = self.anthropic_base_url.clone();
        config.provider.anthropic_api_key = self
            .anthropic_api_key
            .as_ref()
            .map(|k| k.expose().to_owned());
        config.provider.timeout = Duration::from_millis(self.model_timeout_ms);
        if let Some(base) = self.retry_base_ms {
            config.model_retry.base = Duration::from_millis(base);
            config.webhook_retry.base = Duration::from_millis(base);
        }
        Ok(config)
    }
}

/// Parses `90s`, `30m`, `24h`, `7d` (or plain seconds).
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let n: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a duration like 90s, 30m, 24h or 7d"))?;
    let secs = match unit {
        "" | "s" => n,
        "m" => n * 60,
        "h" => n * 3600,
        "d" => n * 86_400,
        "ms" => return Ok(Duration::from_millis(n)),
        other => {
            return Err(format!(
                "unknown unit {other:?} in {text:?}; use ms, s, m, h or d"
            ))
        }
    };
    Ok(Duration::from_secs(secs))
}

/// The database to use: `DATABASE_URL`, or the embedded server (started or adopted).
pub struct Database {
    /// The URL the engine connects with.
    pub url: String,
    /// The embedded server, when onceflow started or adopted it.
    pub embedded: Option<EmbeddedPg>,
}

impl DbArgs {
    /// Resolves the database, starting the embedded server when needed. Blocking.
    pub fn resolve(&self) -> anyhow::Result<Database> {
        if let Some(url) = &self.database_url {
            return Ok(Database {
                url: url.expose().to_owned(),
                embedded: None,
            });
        }
        tracing::info!(data_dir = %self.data_dir.display(), "DATABASE_URL is unset; using the embedded PostgreSQL");
        let pg = EmbeddedPg::start(&self.data_dir).context("starting the embedded PostgreSQL")?;
        Ok(Database {
            url: pg.url("onceflow"),
            embedded: Some(pg),
        })
    }
}

impl Database {
    /// Creates the embedded `onceflow` database if needed, migrates, and
    /// connects. On the embedded server, migrations run as its superuser and
    /// the application connects as `onceflow_app`, a role that is not one.
    pub async fn open(&self, pool: u32) -> anyhow::Result<Db> {
        if let Some(pg) = &self.embedded {
            db::create_database(&pg.url("postgres"), "onceflow", None)
                .await
                .context("creating the onceflow database")?;
            let admin = Db::connect(&self.url, 1)
                .await
                .context("connecting to PostgreSQL")?;
            let applied = admin.migrate().await.context("applying migrations")?;
            if !applied.is_empty() {
                tracing::info!(?applied, "migrations applied");
            }
            drop(admin);
            let password = pg
                .app_password()
                .context("the embedded server has no application role")?;
            db::grant_app_role(
                &self.url,
                "onceflow",
                onceflow_engine::pg::APP_ROLE,
                password,
            )
            .await
            .context("granting the application role")?;
            let app_url = pg
                .app_url("onceflow")
                .context("the application role's URL")?;
            return Db::connect(&app_url, pool)
                .await
                .context("connecting to PostgreSQL as the application role");
        }
        let db = Db::connect(&self.url, pool)
            .await
            .context("connecting to PostgreSQL")?;
        let applied = db.migrate().await.context("applying migrations")?;
        if !applied.is_empty() {
            tracing::info!(?applied, "migrations applied");
        }
        Ok(db)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    #[test]
    fn debug_output_redacts_every_secret() {
        let cli = Cli::parse_from([
            "onceflow",
            "--database-url",
            "postgres://u:db-password-1@h/d",
            "--openai-api-key",
            "sk-live-key-2",
            "--webhook-secret",
            "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
        ]);
        let config = cli.serve.engine_config().unwrap();
        let shown = format!("{cli:?} {config:?}");
        for secret in [
            "db-password-1",
            "sk-live-key-2",
            "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
        ] {
            assert!(!shown.contains(secret), "{secret} shown in {shown}");
        }
        assert_eq!(config.provider.api_key.as_deref(), Some("sk-live-key-2"));
    }
}
