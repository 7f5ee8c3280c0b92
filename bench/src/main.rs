//! # onceflow-bench
//!
//! The demo and the benchmarks of onceflow, apart from the product so that
//! the `onceflow` library and binary do not compile the test kit (the
//! loopback provider and consumer they drive):
//!
//! * `demo` — see the guarantee hold: completion jobs with injected faults,
//!   counted at the fake provider and consumer ([`demo`]).
//! * `bench` — jobs end to end through the HTTP API, against the machine's
//!   commit limit measured with pgbench ([`bench`]; the method is in
//!   `docs/benchmarks.md`).
//!
//! Any other command is the `onceflow` command line itself (`bench --nodes`
//! starts `onceflow-bench serve` children).

use clap::{Parser, Subcommand};

mod bench;
mod demo;

#[derive(Debug, Parser)]
#[command(
    name = "onceflow-bench",
    version,
    about = "onceflow's demo and benchmarks (any other command is onceflow's own)"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// See the guarantee hold: jobs with injected faults against a loopback provider and consumer.
    Demo(demo::DemoArgs),
    /// Benchmark: jobs end to end through the HTTP API against a loopback provider and consumer.
    Bench(bench::BenchArgs),
    /// The loopback provider `bench --hold` runs as a child process.
    #[command(hide = true)]
    FakeProvider(bench::FakeProviderArgs),
}

fn main() -> std::process::ExitCode {
    let ours = std::env::args().nth(1).is_some_and(|c| {
        matches!(
            c.as_str(),
            "demo" | "bench" | "fake-provider" | "help" | "--help" | "-h" | "--version" | "-V"
        )
    });
    let result = if ours {
        let cli = Cli::parse();
        // The engine's INFO lines would bury the tables; RUST_LOG brings them back.
        onceflow_observability::init_logging_at("warn");
        match cli.command {
            Command::Demo(args) => demo::run(args),
            Command::Bench(args) => bench::run(args),
            Command::FakeProvider(args) => bench::fake_provider(args),
        }
    } else {
        onceflow::App::new().run()
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
