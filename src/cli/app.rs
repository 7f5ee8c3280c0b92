//! [`App`]: a onceflow node in your own binary, with your workflows and tools.

use onceflow_engine::Registry;

use super::{client, config, serve, token};
use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "onceflow",
    version,
    about = "A durable, actor-based workflow engine for LLM jobs"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the HTTP API and a worker node (starts an embedded PostgreSQL when DATABASE_URL is unset).
    Serve(Box<config::ServeArgs>),
    /// Apply pending database migrations and exit.
    Migrate(config::DbArgs),
    /// Submit a completion job to a running server and print it.
    Submit(client::SubmitArgs),
    /// Print a job's state and history.
    Status(client::StatusArgs),
    /// Follow a job live: its streamed answer as it is journaled, then its final state.
    Watch(client::WatchArgs),
    /// List jobs, newest first (filter by state or workflow).
    Jobs(client::JobsArgs),
    /// Cancel a live job: nothing new starts; it ends `cancelled`.
    Cancel(client::CancelArgs),
    /// Resume a dead job (or every dead job) from its last checkpoint, with the same keys.
    Redrive(client::RedriveArgs),
    /// Run a job's workflow again on its input, as a new job under a new id.
    Rerun(client::RerunArgs),
    /// Submit up to 1,000 jobs from a JSON file in one request.
    Batch(client::BatchArgs),
    /// Send a job a signal (what its wait asks for, or an approval).
    Signal(client::SignalArgs),
    /// Manage schedules: crons that create jobs (create, list, show, delete, pause, resume).
    Schedule(client::ScheduleArgs),
    /// Manage API tokens (create, list, revoke).
    Token(token::TokenArgs),
}

/// A onceflow node with your workflows and tools: the same command line as
/// the `onceflow` binary (`serve`, `migrate`, `submit`, `status`, `jobs`,
/// `cancel`, `redrive`, `signal`, `schedule`, `token`, `watch`; the same flags and
/// environment; the embedded PostgreSQL by default), with the built-in
/// `completion` and `agent` plus what you register.
///
/// ```no_run
/// # struct Greet;
/// # impl onceflow::Workflow for Greet {
/// #     const NAME: &'static str = "greet";
/// #     type Input = serde_json::Value;
/// #     type Output = serde_json::Value;
/// #     async fn run(&self, _: &mut onceflow::Context, i: serde_json::Value) -> Result<serde_json::Value, onceflow::StepError> { Ok(i) }
/// # }
/// fn main() -> anyhow::Result<()> {
///     onceflow::App::new().workflow(Greet).run()
/// }
/// ```
#[derive(Default)]
pub struct App {
    workflows: Registry,
    tools: Vec<std::sync::Arc<dyn onceflow_workflows::Tool>>,
}

impl App {
    /// The built-in workflows only (what the `onceflow` binary runs).
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers your workflow beside the built-ins. Panics when its `NAME`
    /// is taken, by a built-in (`completion`, `agent`) under any version
    /// too: two workflows sharing a durable name would run each other's
    /// jobs, and a higher version would silently replace the built-in for
    /// every new job.
    pub fn workflow<W: onceflow_engine::Workflow>(mut self, workflow: W) -> Self {
        use onceflow_engine::Workflow as _;
        let built_in = [
            onceflow_workflows::Completion::NAME,
            onceflow_workflows::Agent::NAME,
        ];
        assert!(
            !built_in.contains(&W::NAME),
            "workflow name {:?} belongs to a built-in workflow; give yours a name of its own",
            W::NAME
        );
        self.workflows.register(workflow);
        self
    }

    /// Gives the built-in `agent` workflow your tool (beside `http_post`).
    pub fn tool<T: onceflow_workflows::Tool>(mut self, tool: T) -> Self {
        self.tools.push(std::sync::Arc::new(tool));
        self
    }

    /// Parses the command line (and environment) and runs the command.
    pub fn run(self) -> anyhow::Result<()> {
        use clap::{CommandFactory, FromArgMatches};
        let matches = Cli::command().get_matches();
        if let Some(refused) = secret_on_command_line(&matches) {
            eprintln!("error: {refused}");
            std::process::exit(2);
        }
        let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
        onceflow_observability::init_logging();
        self.run_command(cli.command)
    }

    fn registry(&self, args: &config::ServeArgs) -> anyhow::Result<Registry> {
        use anyhow::Context as _;
        let mcp = match args.mcp_servers.as_deref() {
            Some(setting) => {
                let servers = onceflow_workflows::mcp::McpServers::from_setting(setting)
                    .map_err(anyhow::Error::msg)
                    .context("ONCEFLOW_MCP_SERVERS")?;
                servers
                    .check(&args.engine_config()?.url_guard)
                    .map_err(anyhow::Error::msg)
                    .context("ONCEFLOW_MCP_SERVERS (set ONCEFLOW_ALLOW_PRIVATE_URLS for a server on loopback or a private network)")?;
                tracing::info!(servers = ?servers.names(), "MCP servers configured");
                servers
            }
            None => onceflow_workflows::mcp::McpServers::none(),
        };
        let mut registry =
            onceflow_workflows::registry_with_mcp(args.tool_post_url.as_deref(), &self.tools, mcp);
        registry.extend(&self.workflows);
        Ok(registry)
    }

    fn run_command(self, command: Command) -> anyhow::Result<()> {
        match command {
            Command::Serve(args) => {
                let registry = self.registry(&args)?;
                serve::run(*args, registry)
            }
            Command::Migrate(args) => serve::migrate(args),
            Command::Submit(args) => client::submit(args),
            Command::Status(args) => client::status(args),
            Command::Watch(args) => client::watch(args),
            Command::Token(args) => token::run(args),
            Command::Jobs(args) => client::jobs(args),
            Command::Cancel(args) => client::cancel(args),
            Command::Redrive(args) => client::redrive(args),
            Command::Rerun(args) => client::rerun(args),
            Command::Batch(args) => client::batch(args),
            Command::Signal(args) => client::signal(args),
            Command::Schedule(args) => client::schedule(args),
        }
    }
}

/// The flags that would carry a secret, by argument id, with the
/// environment variable to use instead.
const SECRET_FLAGS: [(&str, &str, &str); 6] = [
    ("token", "--token", "ONCEFLOW_TOKEN"),
    ("openai_api_key", "--openai-api-key", "OPENAI_API_KEY"),
    (
        "anthropic_api_key",
        "--anthropic-api-key",
        "ANTHROPIC_API_KEY",
    ),
    (
        "webhook_secret",
        "--webhook-secret",
        "ONCEFLOW_WEBHOOK_SECRET",
    ),
    ("database_url", "--database-url", "DATABASE_URL"),
    (
        "mcp_servers",
        "--mcp-servers",
        "ONCEFLOW_MCP_SERVERS (or --mcp-servers @file)",
    ),
];

/// Why the command line is refused, when it carries a secret: a flag's
/// value is visible to every user of the machine (`ps`,
/// `/proc/PID/cmdline`). A database URL is refused only with a password in
/// it. The value itself is never repeated.
fn secret_on_command_line(matches: &clap::ArgMatches) -> Option<String> {
    for (id, flag, env) in SECRET_FLAGS {
        let given = matches.try_get_raw(id).is_ok_and(|v| v.is_some())
            && matches.value_source(id) == Some(clap::parser::ValueSource::CommandLine);
        if !given {
            continue;
        }
        if id == "mcp_servers" {
            // A file's path is no secret; the JSON itself may hold one.
            let value = matches
                .try_get_raw(id)
                .ok()
                .flatten()
                .and_then(|mut v| v.next());
            if value
                .and_then(|v| v.to_str())
                .is_some_and(|v| v.starts_with('@'))
            {
                continue;
            }
        }
        if id == "database_url" {
            let url = matches
                .try_get_raw(id)
                .ok()
                .flatten()
                .and_then(|mut v| v.next())
                .and_then(|v| v.to_str())
                .unwrap_or_default();
            if !url_has_password(url) {
                continue;
            }
        }
        return Some(format!(
            "{flag} is refused: a secret on the command line is visible to every user of this \
             machine (ps, /proc/PID/cmdline); set {env} instead"
        ));
    }
    matches
        .subcommand()
        .and_then(|(_, m)| secret_on_command_line(m))
}

/// Whether `url` holds a password: `scheme://user:password@host…`, a
/// `password=` query parameter, or a `password=` keyword (`host=h password=p`).
fn url_has_password(url: &str) -> bool {
    if url.to_ascii_lowercase().contains("password=") {
        return true;
    }
    let Some((_, rest)) = url.split_once("://") else {
        return false;
    };
    let authority = rest.split(['/', '?']).next().unwrap_or_default();
    authority
        .rsplit_once('@')
        .is_some_and(|(userinfo, _)| userinfo.contains(':'))
}

#[cfg(test)]
mod tests {
    use super::url_has_password;

    #[test]
    fn a_password_in_a_database_url_is_found() {
        assert!(url_has_password("postgres://u:p@h:5432/db"));
        assert!(url_has_password("postgres://u:p@h1:1,h2:2/db?x=y"));
        assert!(!url_has_password("postgres://u@h:5432/db"));
        assert!(!url_has_password("postgres://h:5432/db"));
        assert!(!url_has_password("postgres:///db?host=/run/pg&user=a:b"));
        assert!(url_has_password("postgres://u@h/db?password=p"));
        assert!(url_has_password("host=h user=u password=p dbname=d"));
    }
}
