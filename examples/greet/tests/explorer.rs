//! Proving this crate's workflow: a crash or a takeover at every boundary it
//! passes, checked by counting what the fake provider and consumer saw.

use onceflow::engine::testkit::{Explorer, TestEnv};
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
