//! Proving this crate's workflow: a crash or a takeover at every boundary it
//! passes, checked by counting what the fake provider and consumer saw.

use onceflow::engine::testkit::{Explorer, FakeConsumer, TestEnv};
use onceflow::Registry;

#[actix_rt::test]
async fn greet_survives_a_crash_or_a_takeover_at_every_boundary() {
    let env = TestEnv::new().await;
    let registry = || {
        let mut r = Registry::new();
        r.register(greet::Greet);
        r
    };
    let report = Explorer::new(
        &env,
        registry,
        "greet",
        serde_json::json!({ "name": "Ada" }),
    )
    .run()
    .await;
    println!("{report}");
    report.assert_ok();
    assert_eq!(report.boundaries.len(), 13, "{report}");
}

/// The refund waits for a person's approval, then acts once: the explorer
/// crashes and takes over at every boundary (before and after the wait is
/// journaled among them), sends the approval while the crashed job is down,
/// and counts the refunds the payment service received.
#[actix_rt::test]
async fn a_refund_acts_once_after_its_approval_at_every_boundary() {
    let env = TestEnv::new().await;
    let payments = FakeConsumer::start();
    let input =
        serde_json::json!({ "order": "A-7", "amount_cents": 1200, "refund_url": payments.url() });
    let registry = || {
        let mut r = Registry::new();
        r.register(greet::Refund);
        r
    };
    let report = Explorer::new(&env, registry, "refund", input)
        .signal("approve", "d-1", serde_json::json!({ "approved": true }))
        .signals_arrive_during_crashes()
        .recording(payments)
        .run()
        .await;
    println!("{report}");
    report.assert_ok();
    let wait = report
        .boundaries
        .iter()
        .filter(|(b, _)| b.to_string().ends_with(":wait"));
    assert_eq!(
        wait.count(),
        2,
        "before and after the wait is journaled: {report}"
    );
}

/// The map-reduce digest: one model call per chunk, all at once, then one
/// that combines them. Crashed and taken over at every boundary of every
/// chunk's call, each chunk is paid once and the webhook sent once.
#[actix_rt::test]
async fn a_digest_pays_each_chunk_once_at_every_boundary() {
    let env = TestEnv::new().await;
    let text = "one two three four five six seven eight nine ten ".repeat(30);
    let input = serde_json::json!({ "text": text, "chunk_chars": 500 });
    let chunks = greet::digest::chunks(&text, 500).len();
    let registry = || {
        let mut r = Registry::new();
        r.register(greet::Digest);
        r
    };
    let report = Explorer::new(&env, registry, "digest", input).run().await;
    println!("{report}");
    report.assert_ok();
    // The clean run: one request per chunk and one to combine, one webhook.
    assert_eq!(report.clean_requests.0, chunks + 1, "{report}");
    assert_eq!(report.clean_requests.1, 1, "{report}");
    assert!(chunks >= 3, "{chunks} chunks");
    // A crash and a takeover after every chunk's send, in three modes.
    let after_send = report
        .rows
        .iter()
        .filter(|r| r.boundary == onceflow::engine::FailPoint::ModelAfterSend)
        .count();
    assert_eq!(after_send, (chunks + 1) * 3, "{report}");
}
