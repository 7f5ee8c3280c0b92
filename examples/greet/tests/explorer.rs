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
/// sends the approval with each job it submits, crashes and takes over at
/// every boundary (before and after the wait is journaled among them), and
/// counts the refunds the payment service received.
#[actix_rt::test]
async fn a_refund_acts_once_after_its_approval_at_every_boundary() {
    let env = TestEnv::new().await;
    let payments = FakeConsumer::start();
    let input = serde_json::json!({ "order": "A-7", "amount_cents": 1200, "refund_url": payments.url() });
    let registry = || {
        let mut r = Registry::new();
        r.register(greet::Refund);
        r
    };
    let report = Explorer::new(&env, registry, "refund", input)
        .signal("approve", "d-1", serde_json::json!({ "approved": true }))
        .recording(payments)
        .run()
        .await;
    println!("{report}");
    report.assert_ok();
}
