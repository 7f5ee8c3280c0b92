//! Submits a `greet` job to a running node and reads it back, typed:
//! `ONCEFLOW_TOKEN=… cargo run --example client` (the node's URL in
//! `ONCEFLOW_URL`, default `http://127.0.0.1:8080`).

use greet::{Greet, Greeting, Who};

#[actix_rt::main]
async fn main() -> anyhow::Result<()> {
    let base = std::env::var("ONCEFLOW_URL").unwrap_or_else(|_| "http://127.0.0.1:8080".into());
    let token = std::env::var("ONCEFLOW_TOKEN")?;
    let client = onceflow::Client::new(base).with_token(token);
    let submitted = client.submit::<Greet>("hi-1", &Who { name: "Ada".into() }, "https://hooks.example.com/x").await?;
    let job = client.job::<Greeting>("hi-1").await?; // job.state, job.result, job.history
    println!("created: {}; now {:?}", submitted.created, job.state);
    Ok(())
}
