//! # onceflow
//!
//! The binary: `demo` shows the guarantees hold under injected faults; `serve` runs the HTTP API and a node of the engine on
//! PostgreSQL (an embedded one when `DATABASE_URL` is unset); `migrate`
//! applies the schema; `submit` and `status` are clients of a running server;
//! `bench` measures throughput and latency end to end.

mod bench;
mod client;
mod config;
mod demo;
mod serve;
mod token;

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
    /// See the guarantee hold: jobs with injected faults against a loopback provider and consumer.
    Demo(demo::DemoArgs),
    /// Run the HTTP API and a worker node (starts an embedded PostgreSQL when DATABASE_URL is unset).
    Serve(Box<config::ServeArgs>),
    /// Apply pending database migrations and exit.
    Migrate(config::DbArgs),
    /// Submit a completion job to a running server and print it.
    Submit(client::SubmitArgs),
    /// Print a job's state and history.
    Status(client::StatusArgs),
    /// List jobs, newest first (filter by state or workflow).
    Jobs(client::JobsArgs),
    /// Cancel a live job: nothing new starts; it ends `cancelled`.
    Cancel(client::CancelArgs),
    /// Resume a dead job (or every dead job) from its last checkpoint, with the same keys.
    Redrive(client::RedriveArgs),
    /// Manage API tokens (create, list, revoke).
    Token(token::TokenArgs),
    /// Benchmark: jobs end to end through the HTTP API against a loopback provider and consumer.
    Bench(bench::BenchArgs),
    /// The loopback provider `bench --hold` runs as a child process.
    #[command(hide = true)]
    FakeProvider(bench::FakeProviderArgs),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    onceflow_observability::init_logging();
    let result = match cli.command {
        Command::Demo(args) => demo::run(args),
        Command::Serve(args) => serve::run(*args),
        Command::Migrate(args) => serve::migrate(args),
        Command::Submit(args) => client::submit(args),
        Command::Status(args) => client::status(args),
        Command::Token(args) => token::run(args),
        Command::Jobs(args) => client::jobs(args),
        Command::Cancel(args) => client::cancel(args),
        Command::Redrive(args) => client::redrive(args),
        Command::Bench(args) => bench::run(args),
        Command::FakeProvider(args) => bench::fake_provider(args),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
