//! A onceflow node of your own: one workflow and one tool of yours, beside
//! the built-in `completion` and `agent`, with the whole `onceflow` command
//! line (`serve`, `submit`, `status`, `jobs`, `token`, …).
//!
//! ```sh
//! cargo run -- serve          # the API on 127.0.0.1:8080, embedded PostgreSQL
//! curl -X POST localhost:8080/v1/jobs -H 'content-type: application/json' \
//!   -d '{"id": "hi-1", "workflow": "greet", "input": {"name": "Ada"}, "webhook_url": "https://hooks.example.com/x"}'
//! ```

fn main() -> anyhow::Result<()> {
    onceflow::App::new()
        .workflow(greet::Greet)
        .workflow(greet::Refund)
        .workflow(greet::Digest)
        .tool(greet::OrderStatus)
        .run()
}
