//! Fairness between tenants (`engine/src/store/lease.rs`, `ACQUIRE`): a
//! tenant's backlog does not hold back another tenant's jobs, weights set
//! the share of starts, and a concurrency key bounds how many of one key's
//! jobs run at once across every node — each counted at the fake provider;
//! and the walk of live tenants: a tenant leaves it only with no unfinished
//! job, whatever the race with an intake, and an acquire takes a full share
//! across weighted tenants.

use std::collections::HashMap;
use std::time::Duration;

use onceflow_engine::request::{NewJob, Schedule};
use onceflow_engine::store::tokens::Share;
use onceflow_engine::testkit::{wait_until, ProviderRequest, TestEnv};
use onceflow_engine::{JobState, Registry};
use onceflow_workflows::Completion;
use serde_json::json;

const WAIT: Duration = Duration::from_secs(60);

fn registry() -> Registry {
    let mut r = Registry::new();
    r.register(Completion::default());
    r
}

/// A token of a tenant (not admin), with its share; returns its id.
async fn tenant(env: &TestEnv, name: &str, share: Share) -> i64 {
    let token = env.store.tokens().create(name, false).await.unwrap();
    env.store.tokens().set_share(name, share).await.unwrap();
    env.store
        .tokens()
        .authenticate(&token)
        .await
        .unwrap()
        .unwrap()
        .token
}

/// A tenant whose keys run at most 2 jobs at once.
async fn keyed_tenant(env: &TestEnv, name: &str) -> i64 {
    let share = Share {
        key_concurrency: Some(2),
        ..Default::default()
    };
    tenant(env, name, share).await
}

/// Submits a completion job (no webhook) on behalf of token `owner`.
async fn submit(env: &TestEnv, owner: i64, id: &str, key: Option<&str>) {
    let job = NewJob {
        id: id.to_owned(),
        workflow: "completion".into(),
        workflow_version: 1,
        input: json!({ "model": "m", "messages": [{ "role": "user", "content": id }] }),
        webhook_url: String::new(),
        schedule: Schedule {
            concurrency_key: key.map(str::to_owned),
            ..Default::default()
        },
        tags: Default::default(),
    };
    env.store
        .jobs()
        .submit(&onceflow_engine::store::Submission::new(&job).owned(Some(owner), false))
        .await
        .unwrap();
}

/// The environment of a `serve` node named `name` on the test's database
/// and provider (leases of 1 s, a poll of 100 ms, 8 in flight), with a
/// model timeout when given.
fn node_vars(
    env: &TestEnv,
    name: &str,
    model_timeout_ms: Option<&str>,
) -> Vec<(&'static str, String)> {
    let mut vars = vec![
        ("DATABASE_URL", env.db_url.clone()),
        ("OPENAI_BASE_URL", env.provider.base_url()),
        ("ONCEFLOW_NODE_ID", name.to_owned()),
        ("ONCEFLOW_LEASE_MS", "1000".to_owned()),
        ("ONCEFLOW_POLL_MS", "100".to_owned()),
        ("ONCEFLOW_MAX_IN_FLIGHT", "8".to_owned()),
    ];
    if let Some(ms) = model_timeout_ms {
        vars.push(("ONCEFLOW_MODEL_TIMEOUT_MS", ms.to_owned()));
    }
    vars
}

/// Whether node `node` leases a live job that holds a `slot` column (a key
/// slot, a throttle's start slot).
async fn holds(env: &TestEnv, node: &str, slot: &str) -> bool {
    env.sql(&format!(
        "SELECT count(*) AS n FROM jobs WHERE lease_owner = '{node}' AND {slot} IS NOT NULL \
         AND finished_at IS NULL"
    ))
    .await[0]["n"]
        .as_i64()
        .unwrap_or(0)
        > 0
}

/// The job a provider request was made for (keys are `job:{id}:…`).
fn job_of(r: &ProviderRequest) -> String {
    let key = r.idempotency_key.as_deref().unwrap_or_default();
    let rest = key.strip_prefix("job:").unwrap_or(key);
    rest.split(':').next().unwrap_or_default().to_owned()
}

async fn all_acked(env: &TestEnv, n: usize) -> bool {
    wait_until(WAIT, || async {
        env.sql("SELECT count(*) AS n FROM jobs WHERE state = 'acked'")
            .await[0]["n"]
            == json!(n)
    })
    .await
}

/// Tenant A queues 100 jobs on a node that runs 4 at a time; tenant B then
/// submits 5. B's jobs take turns with A's: B's first reaches the provider
/// within a few starts and all five within 10 starts of it (in submission
/// order they would be the last five of 105), and every job is sent once.
#[actix_rt::test]
async fn a_tenants_backlog_does_not_hold_back_another_tenant() {
    let env = TestEnv::new().await;
    env.provider.set_latency(Duration::from_millis(150));
    let a = tenant(&env, "tenant-a", Share::default()).await;
    let b = tenant(&env, "tenant-b", Share::default()).await;
    for i in 0..100 {
        submit(&env, a, &format!("a-{i}"), None).await;
    }
    let mut config = env.config();
    config.max_in_flight = 4;
    let _engine = env.start(registry(), config);
    assert!(
        wait_until(WAIT, || async { env.provider.requests().len() >= 4 }).await,
        "A's jobs start"
    );
    for i in 0..5 {
        submit(&env, b, &format!("b-{i}"), None).await;
    }
    assert!(all_acked(&env, 105).await, "every job is acked");
    let order: Vec<String> = env.provider.requests().iter().map(job_of).collect();
    assert_eq!(order.len(), 105, "one model request per job: {order:?}");
    let first_b = order.iter().position(|j| j.starts_with("b-")).unwrap();
    let last_b = order.iter().rposition(|j| j.starts_with("b-")).unwrap();
    assert!(
        first_b <= 12 && last_b - first_b <= 10,
        "B's five jobs take turns with A's backlog: requests #{} to #{} of {order:?}",
        first_b + 1,
        last_b + 1
    );
}

/// Two tenants with 60 jobs each, weights 3 and 1, on a node that runs 8
/// at a time: of the first 40 model requests, three in four are the
/// heavier tenant's (30 ± 3), measured at the provider.
#[actix_rt::test]
async fn weights_set_each_tenants_share_of_starts() {
    let env = TestEnv::new().await;
    env.provider.set_latency(Duration::from_millis(100));
    let heavy = tenant(
        &env,
        "heavy",
        Share {
            weight: Some(3),
            ..Default::default()
        },
    )
    .await;
    let light = tenant(&env, "light", Share::default()).await;
    // The light tenant's jobs are older: submission order alone would run
    // them first.
    for i in 0..60 {
        submit(&env, light, &format!("light-{i}"), None).await;
    }
    for i in 0..60 {
        submit(&env, heavy, &format!("heavy-{i}"), None).await;
    }
    let mut config = env.config();
    config.max_in_flight = 8;
    let _engine = env.start(registry(), config);
    assert!(all_acked(&env, 120).await, "every job is acked");
    let order: Vec<String> = env.provider.requests().iter().map(job_of).collect();
    assert_eq!(order.len(), 120, "one model request per job");
    let heavy_first = order[..40]
        .iter()
        .filter(|j| j.starts_with("heavy-"))
        .count();
    assert!(
        (27..=33).contains(&heavy_first),
        "weight 3 against 1 gives the heavy tenant 3/4 of the first 40 starts, got {heavy_first}: \
         {order:?}"
    );
}

/// A tenant's `user-1` and `user-2` jobs with a limit of 2 per key, on
/// two nodes that could run 8 each: at the provider, never more than 2
/// calls of one key at once (and 2 reached), while unkeyed jobs run
/// beside them; another tenant's `user-1` is not held back by the first
/// one's; a job held back shows `waiting: {"kind": "concurrency"}`. Every
/// job is sent once.
#[actix_rt::test]
async fn a_concurrency_key_bounds_its_jobs_across_nodes_and_tenants() {
    let env = TestEnv::new().await;
    env.provider.set_latency(Duration::from_millis(200));
    let t = keyed_tenant(&env, "tenant-t").await;
    let u = keyed_tenant(&env, "tenant-u").await;
    let mut key_of: HashMap<String, String> = HashMap::new();
    for i in 0..10 {
        let id = format!("t-user1-{i}");
        submit(&env, t, &id, Some("user-1")).await;
        key_of.insert(id, "t/user-1".into());
    }
    for i in 0..6 {
        let id = format!("t-user2-{i}");
        submit(&env, t, &id, Some("user-2")).await;
        key_of.insert(id, "t/user-2".into());
    }
    for i in 0..6 {
        let id = format!("u-user1-{i}");
        submit(&env, u, &id, Some("user-1")).await;
        key_of.insert(id, "u/user-1".into());
    }
    for i in 0..8 {
        submit(&env, t, &format!("t-free-{i}"), None).await;
    }
    let mut config = env.config();
    config.max_in_flight = 8;
    // A call the engine gave up on (a timeout on a loaded machine) frees
    // its slot while the provider may still be answering it: room enough
    // that none is given up on here, so the provider's count is the slots'.
    config.provider.timeout = Duration::from_secs(20);
    // And a lease no heartbeat on a loaded machine misses: a takeover of
    // a job whose call is still answered shows the provider two calls of
    // one slot (seen once in a full parallel run with 3 s).
    config.lease = Duration::from_secs(10);
    let _one = env.start(registry(), config.clone());
    config.node_id = format!("{}-two", config.node_id);
    let _two = env.start(registry(), config);
    // While they run, one of T's user-1 jobs is seen held back, and says why.
    let seen_waiting = wait_until(WAIT, || async {
        let rows = env
            .sql("SELECT id FROM jobs WHERE concurrency_key = 'user-1' AND tenant <> 0 AND finished_at IS NULL AND lease_owner IS NULL ORDER BY id")
            .await;
        for row in rows.as_array().cloned().unwrap_or_default() {
            let view = env.job(row["id"].as_str().unwrap()).await;
            if view.waiting.as_ref().is_some_and(|w| {
                w["kind"] == "concurrency" && w["key"] == "user-1"
            }) {
                return true;
            }
        }
        false
    })
    .await;
    assert!(
        seen_waiting,
        "a job held back by its key shows waiting kind concurrency"
    );
    assert!(all_acked(&env, 30).await, "every job is acked");
    let requests = env.provider.requests();
    assert_eq!(requests.len(), 30, "one model request per job");
    // Jobs of a key at the provider at once (a request of an attempt a
    // takeover stopped, on a loaded machine, still open there, counts with
    // its job's next one: see `peak_jobs_by`).
    let peaks = peak_jobs_by(&env, |job| key_of.get(job).cloned());
    assert_eq!(
        peaks.get("t/user-1"),
        Some(&2),
        "T's user-1: at most 2 at once, and 2 reached: {peaks:?}"
    );
    for key in ["t/user-2", "u/user-1"] {
        assert!(
            peaks.get(key).is_some_and(|p| (1..=2).contains(p)),
            "{key}: at most 2 at once: {peaks:?}"
        );
    }
    let user1 = env.provider.peak_concurrency_by(|r| {
        key_of
            .get(&job_of(r))
            .filter(|k| k.ends_with("/user-1"))
            .map(|_| "user-1".to_owned())
    });
    assert!(
        user1["user-1"] > 2,
        "U's user-1 runs beside T's (keys belong to their tenant): {user1:?}"
    );
    let everything = env.provider.peak_concurrency();
    assert!(
        everything > 4,
        "unkeyed jobs and other keys run meanwhile (peak {everything})"
    );
}

/// A job that holds its key's only slot when its node dies keeps the slot
/// until it is taken over: the takeover runs it (its own slot does not
/// hold it back), the next job of the key runs after it, never beside it,
/// and each is sent once.
#[actix_rt::test]
async fn a_crashed_jobs_slot_passes_to_its_takeover_then_to_the_next() {
    let env = TestEnv::new().await;
    env.provider.set_latency(Duration::from_millis(100));
    let t = tenant(&env, "tenant-t", Share::default()).await;
    submit(&env, t, "first", Some("conv-1")).await;
    // A node leases it and dies at once: its lease lapses, its slot held.
    let crashed = env.lease("dead-node", Duration::from_millis(300)).await;
    assert_eq!(crashed.fence.job_id, "first");
    let held = env
        .sql("SELECT key_slot FROM jobs WHERE id = 'first'")
        .await[0]["key_slot"]
        .clone();
    assert_eq!(held, json!(0), "the lease took slot 0 of the key");
    submit(&env, t, "second", Some("conv-1")).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let _engine = env.start(registry(), env.config());
    assert!(
        all_acked(&env, 2).await,
        "both jobs are acked: no key stays blocked"
    );
    let order: Vec<String> = env.provider.requests().iter().map(job_of).collect();
    assert_eq!(
        order,
        vec!["first", "second"],
        "each sent once, the held slot's job first"
    );
    let peaks = env.provider.peak_concurrency_by(|r| {
        Some(job_of(r))
            .filter(|j| j == "first" || j == "second")
            .map(|_| "conv-1".into())
    });
    assert_eq!(peaks["conv-1"], 1, "never two of the key at once");
    let first = env.job("first").await;
    assert_eq!(first.state, JobState::Acked);
    assert_eq!(first.attempts, 2, "the crashed attempt, then its takeover");
}

/// A tenant that comes back after a pause gets its share from then on, not
/// a burst for the time it was away: B ran 2 jobs, then A ran 40 alone;
/// when B submits 20 while A still has a backlog, B's and A's starts
/// alternate (3 to 6 of the next 10 are B's), measured at the provider.
#[actix_rt::test]
async fn a_tenant_back_from_a_pause_takes_turns_without_a_burst() {
    back_from_a_pause(1).await;
}

/// The same with both tenants of weight 10 (a start moves a pass on by
/// 0.1): B comes back one of A's starts behind it, not a whole turn (which
/// would give B 10 starts in a row).
#[actix_rt::test]
async fn a_weighted_tenant_back_from_a_pause_takes_turns_without_a_burst() {
    back_from_a_pause(10).await;
}

async fn back_from_a_pause(weight: i32) {
    let env = TestEnv::new().await;
    env.provider.set_latency(Duration::from_millis(40));
    let share = || Share {
        weight: Some(weight),
        ..Default::default()
    };
    let a = tenant(&env, "tenant-a", share()).await;
    let b = tenant(&env, "tenant-b", share()).await;
    let mut config = env.config();
    config.max_in_flight = 2;
    let _engine = env.start(registry(), config);
    for i in 0..2 {
        submit(&env, b, &format!("b-early-{i}"), None).await;
    }
    assert!(all_acked(&env, 2).await, "B's first jobs are acked");
    for i in 0..80 {
        submit(&env, a, &format!("a-{i}"), None).await;
    }
    assert!(
        wait_until(WAIT, || async {
            env.sql("SELECT count(*) AS n FROM jobs WHERE id LIKE 'a-%' AND state = 'acked'")
                .await[0]["n"]
                .as_i64()
                .unwrap_or(0)
                >= 40
        })
        .await,
        "A runs alone for a while"
    );
    for i in 0..20 {
        submit(&env, b, &format!("b-late-{i}"), None).await;
    }
    assert!(all_acked(&env, 102).await, "every job is acked");
    let order: Vec<String> = env.provider.requests().iter().map(job_of).collect();
    assert_eq!(order.len(), 102, "one model request per job");
    let back = order.iter().position(|j| j.starts_with("b-late-")).unwrap();
    let next: Vec<&String> = order[back..back + 10].iter().collect();
    let b_share = next.iter().filter(|j| j.starts_with("b-late-")).count();
    assert!(
        (3..=6).contains(&b_share),
        "B takes turns with A when it comes back ({b_share} of the next 10 starts): {next:?}"
    );
    assert!(
        order[back..].iter().take(10).any(|j| j.starts_with("a-")),
        "A keeps starting jobs"
    );
}

/// Per-key concurrency through kill -9: two `serve` nodes run a tenant's
/// 12 jobs of one key (limit 2) beside 6 without a key; one node is
/// SIGKILLed twice mid-run and restarted. Every job is acked (no key stays
/// blocked by a dead node's slot), each model answer is paid once, and the
/// provider never sees calls of more than 2 of the key's jobs at once.
#[actix_rt::test]
async fn a_concurrency_key_holds_through_kill_9() {
    use crate::support::ServeProcess;
    let env = TestEnv::new().await;
    env.provider.set_latency(Duration::from_millis(300));
    let t = keyed_tenant(&env, "tenant-t").await;
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("serve.log");
    let vars = |name: &str| node_vars(&env, name, Some("3000"));
    let mut killed = ServeProcess::start(&vars("kept-dying"), &log).await;
    let _steady = ServeProcess::start(&vars("steady"), &log).await;
    let mut keyed = std::collections::HashSet::new();
    for i in 0..12 {
        let id = format!("k-{i}");
        submit(&env, t, &id, Some("conv-1")).await;
        keyed.insert(id);
    }
    for i in 0..6 {
        submit(&env, t, &format!("free-{i}"), None).await;
    }
    for round in 0..2 {
        // Killed while it holds a slot of the key: the slot dies with it.
        assert!(
            wait_until(WAIT, || holds(&env, "kept-dying", "key_slot")).await,
            "the node holds a slot of the key before kill {round}"
        );
        killed.sigkill();
        killed.restart_on_same_port(&vars("kept-dying"), &log).await;
    }
    assert!(
        all_acked(&env, 18).await,
        "every job is acked; log:\n{}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    for i in 0..12 {
        let key = format!("job:k-{i}:generate");
        assert_eq!(env.provider.work_done(&key), 1, "{key} paid once");
    }
    for i in 0..6 {
        let key = format!("job:free-{i}:generate");
        assert_eq!(env.provider.work_done(&key), 1, "{key} paid once");
    }
    // Jobs, not requests: the call a killed node left at the provider and
    // its takeover's call under the same key are one job's (paid once,
    // above); a node restarted faster than the provider answers sends the
    // second while the first is still being answered.
    let peak = peak_jobs_at_once(&env, |job| keyed.contains(job));
    assert!(
        (1..=2).contains(&peak),
        "at most 2 jobs of the key at once through the kills: {peak}"
    );
}

/// A token's daily model-token budget (each answer of the fake provider
/// uses 10; a call holds its input's estimate plus the output it allows
/// before it is sent): with 15, the first job runs and spends 10; the
/// second, whose hold does not fit the 5 left, sends nothing and journals
/// nothing. It waits holding no lease, shown as `waiting: {"kind":
/// "budget", "until"}` with `until` in the first 30 s of the next UTC day
/// (held jobs do not all start at once). Raising the budget wakes it: the
/// node runs it on its own, sent once. The spend is what the answers used,
/// counted once each.
#[actix_rt::test]
async fn a_spent_budget_makes_the_next_job_wait_until_the_budget_is_raised() {
    let env = TestEnv::new().await;
    let t = tenant(
        &env,
        "tenant-t",
        Share {
            daily_token_budget: Some(15),
            ..Default::default()
        },
    )
    .await;
    let mut config = env.config();
    // Nothing but the raise's announcement can wake the job in time.
    config.poll_interval = Duration::from_secs(60);
    let _engine = env.start(registry(), config);
    submit(&env, t, "b-1", None).await;
    env.wait_for("b-1", JobState::Acked, WAIT).await;
    submit(&env, t, "b-2", None).await;
    let waited = wait_until(WAIT, || async {
        env.job("b-2")
            .await
            .waiting
            .is_some_and(|w| w["kind"] == "budget")
    })
    .await;
    assert!(waited, "the second job waits for the budget");
    let row = env
        .sql("SELECT state::text AS state, lease_owner, \
                 run_at >= (date_trunc('day', now() AT TIME ZONE 'UTC') + interval '1 day') AT TIME ZONE 'UTC' \
                 AND run_at < (date_trunc('day', now() AT TIME ZONE 'UTC') + interval '1 day 30 seconds') AT TIME ZONE 'UTC' \
                     AS tomorrow, \
                 (SELECT count(*) FROM model_calls WHERE job_id = 'b-2') AS journaled \
             FROM jobs WHERE id = 'b-2'")
        .await[0]
        .clone();
    assert_eq!(row["state"], "received", "{row}");
    assert!(
        row["lease_owner"].is_null(),
        "no lease while it waits: {row}"
    );
    assert_eq!(
        row["tomorrow"], true,
        "it runs again in the first 30 s of the next UTC day: {row}"
    );
    assert_eq!(row["journaled"], 0, "nothing journaled for a call not sent");
    assert_eq!(
        env.provider.requests_for("job:b-2:generate"),
        0,
        "nothing sent"
    );
    let spend = env.store.waits().spend_today(Some(t)).await.unwrap();
    assert_eq!(
        (spend[0].spent_today, spend[0].daily_budget),
        (10, 15),
        "one answer of 10 tokens, counted once"
    );
    // The same per token on /metrics, the token's name its label.
    let base = crate::support::serve_api(&env, registry(), None);
    let text = crate::support::get_text(&format!("{base}/metrics")).await;
    for line in [
        "onceflow_budget_spent{onceflow_token=\"tenant-t\"} 10",
        "onceflow_budget_limit{onceflow_token=\"tenant-t\"} 15",
    ] {
        assert!(text.lines().any(|l| l == line), "{line} in:\n{text}");
    }
    // An operator raises the budget: the node wakes the job on its own.
    let raised = Share {
        daily_token_budget: Some(1_000_000),
        ..Default::default()
    };
    env.store
        .tokens()
        .set_share("tenant-t", raised)
        .await
        .unwrap();
    assert!(
        wait_until(Duration::from_secs(20), || async {
            env.job("b-2").await.state == JobState::Acked
        })
        .await,
        "the raise woke the held job"
    );
    assert_eq!(
        env.provider.requests_for("job:b-2:generate"),
        1,
        "sent once, after the raise"
    );
    let spend = env.store.waits().spend_today(Some(t)).await.unwrap();
    assert_eq!(spend[0].spent_today, 20);
}

/// A budget is a reservation: 40 jobs at once on two nodes, each call
/// holding its input's estimate and its `max_tokens` (20) before it is
/// sent, against a budget of 200: the day's spend never passes 200 (with a
/// check alone, all 40 were sent: 400). The jobs the budget could not
/// take wait for it; clearing the budget wakes them, and every job is then
/// sent once.
#[actix_rt::test]
async fn concurrent_calls_on_two_nodes_never_outspend_a_budget() {
    let env = TestEnv::new().await;
    env.provider.set_latency(Duration::from_millis(300));
    let t = tenant(
        &env,
        "tenant-t",
        Share {
            daily_token_budget: Some(200),
            ..Default::default()
        },
    )
    .await;
    for i in 0..40 {
        let job = NewJob {
            id: format!("r-{i:02}"),
            workflow: "completion".into(),
            workflow_version: 1,
            input: json!({
                "model": "m", "max_tokens": 20,
                "messages": [{ "role": "user", "content": "hi" }],
            }),
            webhook_url: String::new(),
            schedule: Schedule::default(),
            tags: Default::default(),
        };
        env.store
            .jobs()
            .submit(&onceflow_engine::store::Submission::new(&job).owned(Some(t), false))
            .await
            .unwrap();
    }
    let mut config = env.config();
    config.max_in_flight = 20;
    config.provider.timeout = Duration::from_secs(20);
    let _one = env.start(registry(), config.clone());
    config.node_id = format!("{}-two", config.node_id);
    let _two = env.start(registry(), config);
    let settled = wait_until(WAIT, || async {
        env.sql(
            "SELECT count(*) FILTER (WHERE state = 'acked') + count(*) FILTER (WHERE waiting->>'kind' = 'budget' \
                 AND run_at >= (date_trunc('day', now() AT TIME ZONE 'UTC') + interval '1 day') \
                     AT TIME ZONE 'UTC') AS n FROM jobs",
        )
        .await[0]["n"]
            == json!(40)
    })
    .await;
    assert!(settled, "every job acked or waiting for the next day");
    let spent = env.store.waits().spend_today(Some(t)).await.unwrap()[0].spent_today;
    let sent = env.provider.requests().len() as i64;
    assert!(
        sent > 0 && spent == sent * 10,
        "{sent} calls, {spent} spent"
    );
    assert!(
        spent <= 200,
        "{spent} spent of a budget of 200 ({sent} calls)"
    );
    // Calls ran while their holds (about 40 tokens: a request's bytes / 4
    // plus its max_tokens) fit: what is left is less than one hold.
    assert!(
        spent >= 140,
        "only {spent} spent of a budget of 200 ({sent} calls)"
    );
    let cleared = Share {
        clear: onceflow_engine::store::tokens::Cleared {
            daily_token_budget: true,
            ..Default::default()
        },
        ..Default::default()
    };
    env.store
        .tokens()
        .set_share("tenant-t", cleared)
        .await
        .unwrap();
    assert!(all_acked(&env, 40).await, "the clear woke every held job");
    assert_eq!(env.provider.requests().len(), 40, "each sent once");
}

/// A token configured to die on a spent budget: its second job dies
/// `budget_exhausted` before its model call, which is never sent.
#[actix_rt::test]
async fn a_spent_budget_can_kill_the_next_job_before_its_call() {
    let env = TestEnv::new().await;
    let t = tenant(
        &env,
        "tenant-d",
        Share {
            daily_token_budget: Some(10),
            budget_exhausted: Some("die"),
            ..Default::default()
        },
    )
    .await;
    let _engine = env.start(registry(), env.config());
    submit(&env, t, "d-1", None).await;
    env.wait_for("d-1", JobState::Acked, WAIT).await;
    submit(&env, t, "d-2", None).await;
    let dead = env.wait_for("d-2", JobState::Dead, WAIT).await;
    assert_eq!(
        dead.last_error.as_ref().map(|e| e.code.as_str()),
        Some("budget_exhausted")
    );
    assert!(
        dead.dead_reason
            .as_deref()
            .is_some_and(|r| r.starts_with("budget_exhausted")),
        "{:?}",
        dead.dead_reason
    );
    assert_eq!(
        env.provider.requests_for("job:d-2:generate"),
        0,
        "never sent"
    );
    assert_eq!(env.provider.requests_for("job:d-1:generate"), 1);
}

/// Jobs of admin tokens and development mode are one more tenant, not a
/// line that goes first: at priority 0 they take turns with a tenant's,
/// also on a node that runs one job at a time (an acquire of 1); only a
/// positive priority of theirs cuts ahead.
#[actix_rt::test]
async fn admin_jobs_take_turns_unless_their_priority_cuts_ahead() {
    let env = TestEnv::new().await;
    env.provider.set_latency(Duration::from_millis(20));
    let b = tenant(&env, "tenant-b", Share::default()).await;
    for i in 0..30 {
        // No owner: development mode, tenant 0.
        env.submit_job(NewJob {
            id: format!("house-{i}"),
            workflow: "completion".into(),
            workflow_version: 1,
            input: json!({ "model": "m", "messages": [{ "role": "user", "content": "x" }] }),
            webhook_url: String::new(),
            schedule: Default::default(),
            tags: Default::default(),
        })
        .await;
    }
    for i in 0..5 {
        submit(&env, b, &format!("b-{i}"), None).await;
    }
    env.submit_job(NewJob {
        id: "house-urgent".into(),
        workflow: "completion".into(),
        workflow_version: 1,
        input: json!({ "model": "m", "messages": [{ "role": "user", "content": "x" }] }),
        webhook_url: String::new(),
        schedule: Schedule {
            priority: 5,
            ..Default::default()
        },
        tags: Default::default(),
    })
    .await;
    let mut config = env.config();
    config.max_in_flight = 1;
    let _engine = env.start(registry(), config);
    assert!(all_acked(&env, 36).await, "every job is acked");
    let order: Vec<String> = env.provider.requests().iter().map(job_of).collect();
    assert_eq!(order.len(), 36, "one model request per job");
    assert_eq!(
        order[0], "house-urgent",
        "an admin priority cuts ahead: {order:?}"
    );
    let last_b = order.iter().rposition(|j| j.starts_with("b-")).unwrap();
    assert!(
        last_b <= 12,
        "at priority 0 the house's jobs take turns with B's (B's last is request #{}): {order:?}",
        last_b + 1
    );
}

/// A tenant whose keys start at most `starts` jobs per `per_s` seconds (and
/// run up to 8 at once, so the throttle is what binds).
async fn throttled_tenant(env: &TestEnv, name: &str, starts: i32, per_s: i32) -> i64 {
    let share = Share {
        key_concurrency: Some(8),
        key_throttle: Some((starts, per_s)),
        ..Default::default()
    };
    tenant(env, name, share).await
}

/// The distinct jobs of `prefix` the provider was asked about.
fn jobs_sent(env: &TestEnv, prefix: &str) -> std::collections::BTreeSet<String> {
    env.provider
        .requests()
        .iter()
        .map(job_of)
        .filter(|j| j.starts_with(prefix))
        .collect()
}

/// A throttle of 3 starts per hour per key, on two nodes: exactly 3 of the
/// key's 8 jobs reach the provider, each once, while another key of the
/// same tenant and unkeyed jobs run; the other 5 wait holding no lease,
/// shown as `waiting: {"kind": "throttle", "key", "until"}` with `until`
/// an hour after the first start. When the hour has passed (the stamps
/// moved back by hand), 3 more start, then the last 2: none waits forever.
#[actix_rt::test]
async fn a_key_throttle_bounds_starts_per_period_across_nodes() {
    let env = TestEnv::new().await;
    let t = throttled_tenant(&env, "tenant-t", 3, 3600).await;
    for i in 0..8 {
        submit(&env, t, &format!("a-{i}"), Some("user-1")).await;
    }
    for i in 0..2 {
        submit(&env, t, &format!("b-{i}"), Some("user-2")).await;
    }
    for i in 0..3 {
        submit(&env, t, &format!("free-{i}"), None).await;
    }
    let mut config = env.config();
    config.max_in_flight = 8;
    let _one = env.start(registry(), config.clone());
    config.node_id = format!("{}-two", config.node_id);
    let _two = env.start(registry(), config);
    assert!(all_acked(&env, 8).await, "3 of user-1, 2 of user-2, 3 free");
    // Both nodes keep polling (every second); nothing more may start.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        jobs_sent(&env, "a-").len(),
        3,
        "3 starts of user-1 in the hour, counted at the provider"
    );
    assert_eq!(jobs_sent(&env, "b-").len(), 2, "user-2 has its own 3");
    assert_eq!(env.provider.requests().len(), 8, "each sent once");
    let waiting = env
        .sql("SELECT id FROM jobs WHERE id LIKE 'a-%' AND finished_at IS NULL ORDER BY id")
        .await;
    let waiting: Vec<String> = waiting
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(waiting.len(), 5);
    let first_start = env
        .sql("SELECT to_char((min(throttle_at) + interval '1 hour') AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"') AS at FROM jobs WHERE id LIKE 'a-%'")
        .await[0]["at"]
        .clone();
    for id in &waiting {
        let view = env.job(id).await;
        let w = view.waiting.clone().unwrap_or_default();
        assert_eq!(w["kind"], "throttle", "{id}: {w}");
        assert_eq!(w["key"], "user-1", "{id}: {w}");
        assert_eq!(
            w["until"], first_start,
            "{id}: the first start slot frees then"
        );
        let row = env
            .sql(&format!("SELECT lease_owner FROM jobs WHERE id = '{id}'"))
            .await;
        assert!(row[0]["lease_owner"].is_null(), "{id} holds no lease");
    }
    // The list shows them by that reason (read, never stored), and no other.
    let base = crate::support::serve_api(&env, registry(), None);
    let (status, page) = crate::support::get(&format!("{base}/v1/jobs?waiting=throttle")).await;
    assert_eq!(status, 200, "{page}");
    let mut listed: Vec<String> = page["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["id"].as_str().unwrap().to_owned())
        .collect();
    listed.sort();
    assert_eq!(listed, waiting, "?waiting=throttle lists the 5");
    assert_eq!(page["jobs"][0]["token"], "tenant-t", "each with its tenant");
    let (_, page) = crate::support::get(&format!("{base}/v1/jobs?waiting=concurrency")).await;
    assert_eq!(page["jobs"], json!([]), "none waits for a slot");
    // An hour passes for the key: three more, then the last two.
    env.execute("UPDATE jobs SET throttle_at = throttle_at - interval '1 hour' WHERE throttle_at IS NOT NULL")
        .await;
    assert!(all_acked(&env, 11).await, "the next 3 start");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        jobs_sent(&env, "a-").len(),
        6,
        "only 3 more in the new hour"
    );
    env.execute("UPDATE jobs SET throttle_at = throttle_at - interval '1 hour' WHERE throttle_at IS NOT NULL")
        .await;
    assert!(all_acked(&env, 13).await, "the last 2 start");
    for i in 0..8 {
        let key = format!("job:a-{i}:generate");
        assert_eq!(env.provider.requests_for(&key), 1, "{key} sent once");
    }
}

/// A short throttle (2 starts per 2 s) on two nodes: every job of the key
/// runs, and no 3 of them reach the provider within 1 s of each other (a
/// start is stamped when leased, so a job reaches the provider a little
/// after its start; unthrottled, all 6 arrive together).
#[actix_rt::test]
async fn a_key_throttle_spaces_the_starts_it_lets_through() {
    let env = TestEnv::new().await;
    let t = throttled_tenant(&env, "tenant-t", 2, 2).await;
    for i in 0..6 {
        submit(&env, t, &format!("s-{i}"), Some("user-1")).await;
    }
    let mut config = env.config();
    config.max_in_flight = 8;
    let _one = env.start(registry(), config.clone());
    config.node_id = format!("{}-two", config.node_id);
    let _two = env.start(registry(), config);
    assert!(all_acked(&env, 6).await, "every job of the key runs");
    let mut arrivals: Vec<std::time::Instant> = env
        .provider
        .requests()
        .iter()
        .map(|r| r.received_at)
        .collect();
    assert_eq!(arrivals.len(), 6, "each sent once");
    arrivals.sort();
    for w in arrivals.windows(3) {
        assert!(
            w[2] - w[0] >= Duration::from_secs(1),
            "3 starts within {:?}: the throttle lets 2 per 2 s",
            w[2] - w[0]
        );
    }
}

/// A throttled key through kill -9 (two `serve` nodes, one SIGKILLed while
/// it runs a job of the key): the job it held is taken over without a new
/// start (its retries and takeovers are not starts), so exactly 4 of the
/// key's 8 jobs reach the provider in the hour, each paid once, and the
/// rest wait.
#[actix_rt::test]
async fn a_key_throttle_holds_through_kill_9() {
    use crate::support::ServeProcess;
    let env = TestEnv::new().await;
    env.provider.set_latency(Duration::from_millis(1500));
    let t = throttled_tenant(&env, "tenant-t", 4, 3600).await;
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("serve.log");
    let vars = |name: &str| node_vars(&env, name, None);
    let mut killed = ServeProcess::start(&vars("kept-dying"), &log).await;
    for i in 0..8 {
        submit(&env, t, &format!("k-{i}"), Some("conv-1")).await;
    }
    assert!(
        wait_until(WAIT, || holds(&env, "kept-dying", "throttle_slot")).await,
        "the node runs a throttled job before the kill"
    );
    // The second node starts only now: started with the first, on a busy
    // machine it could take all 4 start slots before the first polled.
    let _steady = ServeProcess::start(&vars("steady"), &log).await;
    killed.sigkill();
    killed.restart_on_same_port(&vars("kept-dying"), &log).await;
    assert!(
        all_acked(&env, 4).await,
        "the 4 started are acked, the killed one's by its takeover; log:\n{}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    let sent = jobs_sent(&env, "k-");
    assert_eq!(sent.len(), 4, "4 starts in the hour: {sent:?}");
    for id in &sent {
        let key = format!("job:{id}:generate");
        assert_eq!(env.provider.work_done(&key), 1, "{key} paid once");
    }
    let stamped = env
        .sql("SELECT count(*) AS n, count(DISTINCT throttle_slot) AS slots FROM jobs WHERE throttle_slot IS NOT NULL")
        .await[0]
        .clone();
    assert_eq!(stamped["n"], 4, "4 start slots taken: {stamped}");
    assert_eq!(stamped["slots"], 4, "each its own: {stamped}");
}

/// Jobs of one key under different throttles (the token's throttle changed
/// between them): one acquire gives start slots under one throttle only,
/// so two lists of free slots never hand out one slot twice in a statement
/// (which failed every acquire of every node until the older slot aged).
/// Every job runs, another tenant's included.
#[actix_rt::test]
async fn jobs_of_one_key_under_two_throttles_never_wedge_the_acquire() {
    let env = TestEnv::new().await;
    let t = throttled_tenant(&env, "tenant-t", 2, 3600).await;
    let other = tenant(&env, "tenant-o", Share::default()).await;
    // Slot 0 of the key was taken ten minutes ago.
    submit(&env, t, "first", Some("k")).await;
    {
        let engine = env.start(registry(), env.config());
        env.wait_for("first", JobState::Acked, WAIT).await;
        engine.shutdown();
    }
    env.execute("UPDATE jobs SET throttle_at = now() - interval '10 minutes' WHERE id = 'first'")
        .await;
    // X: 2 per hour (slot 0 not free for it); Y: 2 per minute (both free).
    submit(&env, t, "x", Some("k")).await;
    let per_minute = Share {
        key_throttle: Some((2, 60)),
        ..Default::default()
    };
    env.store
        .tokens()
        .set_share("tenant-t", per_minute)
        .await
        .unwrap();
    submit(&env, t, "y", Some("k")).await;
    submit(&env, other, "z", None).await;
    let rows = env
        .sql("SELECT id, throttle_limit, throttle_period_s FROM jobs WHERE id IN ('x', 'y') ORDER BY id")
        .await;
    assert_eq!(rows[0]["throttle_period_s"], 3600, "{rows}");
    assert_eq!(rows[1]["throttle_period_s"], 60, "{rows}");
    let _engine = env.start(registry(), env.config());
    for id in ["x", "y", "z"] {
        env.wait_for(id, JobState::Acked, WAIT).await;
    }
    let slots = env
        .sql("SELECT count(DISTINCT (throttle_slot, throttle_gen)) AS n FROM jobs WHERE concurrency_key = 'k'")
        .await;
    assert_eq!(slots[0]["n"], 3, "each start its own slot generation");
}

/// A workflow that sets a throttle per key (30 starts a minute) and does
/// nothing else.
struct ThrottledFlow;

impl onceflow_engine::Workflow for ThrottledFlow {
    const NAME: &'static str = "test.throttled";
    type Input = serde_json::Value;
    type Output = serde_json::Value;

    async fn run(
        &self,
        _: &mut onceflow_engine::Context,
        _: serde_json::Value,
    ) -> Result<serde_json::Value, onceflow_engine::StepError> {
        Ok(json!("done"))
    }

    fn throttle_per_key(&self) -> Option<onceflow_engine::Throttle> {
        Some(onceflow_engine::Throttle::new(30, Duration::from_secs(60)))
    }
}

/// With both a token's throttle (1 a second) and a workflow's (30 a
/// minute), a job takes the fewer starts over the longer period (1 a
/// minute): as strict as each, never the looser of them.
#[actix_rt::test]
async fn a_token_and_a_workflow_throttle_together_are_as_strict_as_each() {
    let env = TestEnv::new().await;
    let t = throttled_tenant(&env, "tenant-t", 1, 1).await;
    let mut registry = registry();
    registry.register(ThrottledFlow);
    let body = json!({
        "id": "both", "workflow": "test.throttled", "input": {}, "concurrency_key": "k",
    });
    let job = onceflow_engine::node::intake::parse(
        body.to_string().as_bytes(),
        &registry,
        &onceflow_engine::UrlGuard::allow_private(),
    )
    .unwrap();
    env.store
        .jobs()
        .submit(&onceflow_engine::store::Submission::new(&job).owned(Some(t), false))
        .await
        .unwrap();
    let row = env
        .sql("SELECT throttle_limit, throttle_period_s FROM jobs WHERE id = 'both'")
        .await[0]
        .clone();
    assert_eq!(
        (
            row["throttle_limit"].clone(),
            row["throttle_period_s"].clone()
        ),
        (json!(1), json!(60)),
        "{row}"
    );
}

/// Retention keeps a finished job whose throttle start is still within its
/// period (its row is what counts the start), then purges it.
#[actix_rt::test]
async fn retention_keeps_a_throttle_start_until_its_period_is_over() {
    let env = TestEnv::new().await;
    let t = throttled_tenant(&env, "tenant-t", 1, 3600).await;
    submit(&env, t, "started", Some("k")).await;
    let engine = env.start(registry(), env.config());
    env.wait_for("started", JobState::Acked, WAIT).await;
    engine.shutdown();
    env.execute("UPDATE jobs SET finished_at = now() - interval '2 days' WHERE id = 'started'")
        .await;
    let purged = env
        .store
        .retention()
        .purge_finished(1000, 100)
        .await
        .unwrap();
    assert_eq!(purged, 0, "kept: its start counts for the hour");
    submit(&env, t, "next", Some("k")).await;
    let _engine = env.start(registry(), env.config());
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        env.provider.requests_for("job:next:generate"),
        0,
        "the key's one start this hour is used"
    );
    env.execute(
        "UPDATE jobs SET throttle_at = throttle_at - interval '2 hours' WHERE id = 'started'",
    )
    .await;
    let purged = env
        .store
        .retention()
        .purge_finished(1000, 100)
        .await
        .unwrap();
    assert_eq!(purged, 1, "its period over, it goes");
    env.wait_for("next", JobState::Acked, WAIT).await;
}

/// `token set --clear key-throttle` removes a token's throttle: a job of
/// the key submitted after it starts at once, while the one submitted
/// under the throttle keeps it (a job's throttle is fixed at intake) and
/// waits; the list shows none. Setting and clearing one setting together
/// is refused, naming it, and changes nothing.
#[actix_rt::test]
async fn a_cleared_throttle_holds_back_no_job_submitted_after() {
    let env = TestEnv::new().await;
    let t = throttled_tenant(&env, "tenant-t", 1, 3600).await;
    submit(&env, t, "before-0", Some("user-1")).await;
    submit(&env, t, "before-1", Some("user-1")).await;
    let _engine = env.start(registry(), env.config());
    assert!(all_acked(&env, 1).await, "one start in the hour");
    let both = Share {
        key_throttle: Some((5, 60)),
        clear: onceflow_engine::store::tokens::Cleared {
            key_throttle: true,
            ..Default::default()
        },
        ..Default::default()
    };
    let refused = env.store.tokens().set_share("tenant-t", both).await;
    assert!(
        refused
            .as_ref()
            .is_err_and(|e| e.to_string().contains("--key-throttle")),
        "{refused:?}"
    );
    let listed = env.store.tokens().list().await.unwrap();
    assert_eq!(
        listed[0].key_throttle,
        Some(1),
        "the refused change changed nothing"
    );
    let clear = Share {
        clear: onceflow_engine::store::tokens::Cleared {
            key_throttle: true,
            ..Default::default()
        },
        ..Default::default()
    };
    env.store
        .tokens()
        .set_share("tenant-t", clear)
        .await
        .unwrap();
    let listed = env.store.tokens().list().await.unwrap();
    assert_eq!(
        (listed[0].key_throttle, listed[0].key_throttle_period_s),
        (None, None),
        "the token has no throttle"
    );
    assert_eq!(listed[0].key_concurrency, Some(8), "the rest is kept");
    submit(&env, t, "after", Some("user-1")).await;
    env.wait_for("after", JobState::Acked, WAIT).await;
    assert_eq!(
        jobs_sent(&env, "before-").len(),
        1,
        "the job submitted under the throttle still waits for its hour"
    );
    let held = env
        .sql("SELECT id FROM jobs WHERE id LIKE 'before-%' AND finished_at IS NULL")
        .await;
    let held = held[0]["id"].as_str().unwrap().to_owned();
    assert_eq!(env.job(&held).await.waiting.unwrap()["kind"], "throttle");
}

/// How many model requests the provider received for job `id`.
fn sends(env: &TestEnv, id: &str) -> usize {
    env.provider
        .requests()
        .iter()
        .filter(|r| job_of(r) == id)
        .count()
}

/// Whether tenant `t` is in the acquire's walk (`tenant_turns.live`).
async fn live(env: &TestEnv, t: i64) -> bool {
    env.sql(&format!("SELECT live FROM tenant_turns WHERE tenant = {t}"))
        .await[0]["live"]
        == json!(true)
}

/// A tenant whose jobs are all finished leaves the acquire's walk (the
/// node that acked its last job looks); its next job brings it back (the
/// intake's trigger) and runs.
#[actix_rt::test]
async fn a_tenant_left_idle_comes_back_with_its_next_job() {
    let env = TestEnv::new().await;
    let t = tenant(&env, "tenant-t", Share::default()).await;
    submit(&env, t, "first", None).await;
    assert!(live(&env, t).await, "a tenant with a queued job is walked");
    let _engine = env.start(registry(), env.config());
    env.wait_for("first", JobState::Acked, WAIT).await;
    // The node that acked it looks for idle tenants at once.
    assert!(
        wait_until(WAIT, || async { !live(&env, t).await }).await,
        "the tenant with no unfinished job left the walk"
    );
    let rested = env.store.leases().rest_idle_tenants().await.unwrap();
    assert_eq!(rested, 0, "nothing left to rest");
    submit(&env, t, "second", None).await;
    assert!(live(&env, t).await, "its next job brought it back");
    env.wait_for("second", JobState::Acked, WAIT).await;
    assert_eq!(sends(&env, "first"), 1);
    assert_eq!(sends(&env, "second"), 1);
}

/// The sweep that takes an idle tenant out of the walk races an intake of
/// that tenant still open: it finds the tenant locked by the intake's
/// trigger and leaves it in. (Without its lock, it marks the tenant idle
/// under the open intake, and the job is never taken.)
#[actix_rt::test]
async fn the_idle_sweep_leaves_a_tenant_with_an_open_intake_in_the_walk() {
    use diesel_async::{AsyncConnection, AsyncPgConnection, SimpleAsyncConnection};
    let env = TestEnv::new().await;
    let t = tenant(&env, "tenant-t", Share::default()).await;
    submit(&env, t, "source", None).await;
    // An intake of the same tenant, open: its trigger saw the tenant live.
    let mut intake = AsyncPgConnection::establish(&env.db_url).await.unwrap();
    intake
        .batch_execute(
            "BEGIN; INSERT INTO jobs SELECT (jsonb_populate_record(NULL::jobs, \
                 to_jsonb(j) || '{\"id\": \"late\"}')).* FROM jobs j WHERE id = 'source'",
        )
        .await
        .unwrap();
    // The tenant's only committed job finishes: seen from outside, idle.
    env.store
        .jobs()
        .cancel("source", "test", "the tenant's last committed job ends")
        .await
        .unwrap();
    let rested = env.store.leases().rest_idle_tenants().await.unwrap();
    assert_eq!(
        rested, 0,
        "the open intake's lock keeps its tenant in the walk"
    );
    assert!(live(&env, t).await);
    intake.batch_execute("COMMIT").await.unwrap();
    assert!(live(&env, t).await);
    let _engine = env.start(registry(), env.config());
    env.wait_for("late", JobState::Acked, WAIT).await;
    assert_eq!(sends(&env, "late"), 1);
    assert_eq!(sends(&env, "source"), 0, "the cancelled job was never sent");
}

/// An intake that comes while the sweep holds its lock on the tenant waits
/// for the sweep, then finds the tenant out of the walk and puts it back
/// (the trigger looks again after its wait), and its job runs.
#[actix_rt::test]
async fn an_intake_behind_the_sweeps_lock_puts_its_tenant_back() {
    use diesel_async::{AsyncConnection, AsyncPgConnection, SimpleAsyncConnection};
    let env = TestEnv::new().await;
    let t = tenant(&env, "tenant-t", Share::default()).await;
    submit(&env, t, "source", None).await;
    env.store
        .jobs()
        .cancel("source", "test", "the tenant is idle")
        .await
        .unwrap();
    // The sweep, between its lock and its commit.
    let mut sweep = AsyncPgConnection::establish(&env.db_url).await.unwrap();
    sweep
        .batch_execute(&format!(
            "BEGIN; SELECT tenant FROM tenant_turns WHERE tenant = {t} FOR UPDATE; \
             UPDATE tenant_turns SET live = false WHERE tenant = {t}"
        ))
        .await
        .unwrap();
    let store = env.store.clone();
    let intake = tokio::spawn(async move {
        let job = NewJob {
            id: "late".into(),
            workflow: "completion".into(),
            workflow_version: 1,
            input: json!({ "model": "m", "messages": [{ "role": "user", "content": "late" }] }),
            webhook_url: String::new(),
            schedule: Schedule::default(),
            tags: Default::default(),
        };
        store
            .jobs()
            .submit(&onceflow_engine::store::Submission::new(&job).owned(Some(t), false))
            .await
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !intake.is_finished(),
        "the intake waits for the sweep's lock"
    );
    sweep.batch_execute("COMMIT").await.unwrap();
    intake.await.unwrap().unwrap();
    assert!(live(&env, t).await, "the intake put its tenant back");
    let _engine = env.start(registry(), env.config());
    env.wait_for("late", JobState::Acked, WAIT).await;
    assert_eq!(sends(&env, "late"), 1);
}

/// Forty tenants of weights from 1 to 1,000, three jobs each, taken by
/// acquires of 16 with nothing else running: each acquire takes 16 (or all
/// that is left), never fewer, and every job is taken once. (A line cut at
/// a turn some tenant's line does not reach would take fewer; one cut below
/// zero would fail the statement.)
#[actix_rt::test]
async fn acquires_take_a_full_share_across_weighted_tenants() {
    let env = TestEnv::new().await;
    let weights = [1, 2, 3, 5, 10, 50, 100, 1000];
    for i in 0..40 {
        let share = Share {
            weight: Some(weights[i % weights.len()]),
            ..Default::default()
        };
        let t = tenant(&env, &format!("tenant-{i}"), share).await;
        for j in 0..3 {
            submit(&env, t, &format!("t{i}-{j}"), None).await;
        }
    }
    let mut taken = std::collections::BTreeSet::new();
    let mut left = 120;
    while left > 0 {
        let leased = env
            .store
            .leases()
            .acquire("node-a", 16, 600_000, false, None, &[])
            .await
            .unwrap();
        assert_eq!(leased.len(), left.min(16), "a full acquire ({left} left)");
        for l in leased {
            assert!(
                taken.insert(l.fence.job_id.clone()),
                "{} taken twice",
                l.fence.job_id
            );
        }
        left -= left.min(16);
    }
    assert_eq!(taken.len(), 120);
}

/// A key's slot that frees wakes the nodes: six jobs of a key limited to
/// one, on two nodes whose regular poll is a minute away, run one after
/// another, each started when the one before let its slot go (without the
/// announcement, the second waited for a poll). Never two at once.
#[actix_rt::test]
async fn a_freed_key_slot_wakes_the_nodes_without_the_poll() {
    let env = TestEnv::new().await;
    env.provider.set_latency(Duration::from_millis(100));
    let share = Share {
        key_concurrency: Some(1),
        ..Default::default()
    };
    let t = tenant(&env, "tenant-t", share).await;
    for i in 0..6 {
        submit(&env, t, &format!("k-{i}"), Some("one-at-a-time")).await;
    }
    let mut config = env.config();
    config.poll_interval = Duration::from_secs(60);
    config.provider.timeout = Duration::from_secs(20);
    // A heartbeat missed on a loaded machine must not hand a running job
    // over (its call sent again beside the first).
    config.lease = Duration::from_secs(10);
    let _one = env.start(registry(), config.clone());
    config.node_id = format!("{}-two", config.node_id);
    let _two = env.start(registry(), config);
    assert!(
        all_acked(&env, 6).await,
        "every job of the key acked with no poll"
    );
    assert_eq!(
        env.provider.requests().len(),
        6,
        "one model request per job"
    );
    assert_eq!(
        env.provider.peak_concurrency(),
        1,
        "one at a time: the key's limit"
    );
}

/// A throttle's start slot that frees wakes the node that took it: three
/// jobs of a key throttled to one start per 2 s, on two nodes whose
/// regular poll is a minute away, all start within 30 s (each when the
/// start before it has had its period), each once.
#[actix_rt::test]
async fn a_freed_throttle_slot_wakes_a_node_without_the_poll() {
    let env = TestEnv::new().await;
    let t = throttled_tenant(&env, "tenant-t", 1, 2).await;
    for i in 0..3 {
        submit(&env, t, &format!("th-{i}"), Some("paced")).await;
    }
    let mut config = env.config();
    config.poll_interval = Duration::from_secs(60);
    config.provider.timeout = Duration::from_secs(20);
    let _one = env.start(registry(), config.clone());
    config.node_id = format!("{}-two", config.node_id);
    let _two = env.start(registry(), config);
    assert!(
        wait_until(Duration::from_secs(30), || async {
            env.sql("SELECT count(*) AS n FROM jobs WHERE state = 'acked'")
                .await[0]["n"]
                == json!(3)
        })
        .await,
        "every throttled job started with no poll"
    );
    assert_eq!(jobs_sent(&env, "th-").len(), 3);
    assert_eq!(
        env.provider.requests().len(),
        3,
        "one model request per job"
    );
}

/// A job waiting for a provider slot holds no node capacity: tenant A
/// queues 60 jobs on a model limited to one call at a time (1 s each), on
/// two nodes of 8 in flight; tenant B's 5 jobs on another model start at
/// once beside them, all acked while A has at most 3 acked (before, A's
/// waiting calls filled every node's room, and B's jobs got in only as A's
/// finished: 5 or more of A's first). A's calls never overlap, each is
/// sent once, and a held job shows `waiting: {"kind": "provider", "key"}`.
#[actix_rt::test]
async fn jobs_waiting_for_a_provider_slot_hold_back_no_other_tenant() {
    let env = TestEnv::new().await;
    env.provider.set_latency(Duration::from_millis(1000));
    let a = tenant(&env, "tenant-a", Share::default()).await;
    let b = tenant(&env, "tenant-b", Share::default()).await;
    let job = |id: String, model: &str| NewJob {
        id,
        workflow: "completion".into(),
        workflow_version: 1,
        input: json!({ "model": model, "messages": [{ "role": "user", "content": "hi" }] }),
        webhook_url: String::new(),
        schedule: Schedule::default(),
        tags: Default::default(),
    };
    let submit_as = |owner: i64, job: NewJob| {
        let env = &env;
        async move {
            env.store
                .jobs()
                .submit(&onceflow_engine::store::Submission::new(&job).owned(Some(owner), false))
                .await
                .unwrap();
        }
    };
    for i in 0..60 {
        submit_as(a, job(format!("a-{i:02}"), "slow-model")).await;
    }
    let mut config = env.config();
    config.max_in_flight = 8;
    config.provider.timeout = Duration::from_secs(20);
    config.limits =
        onceflow_engine::rules::quota::Limits::parse(r#"{"slow-model": {"concurrency": 1}}"#)
            .unwrap();
    let _one = env.start(registry(), config.clone());
    config.node_id = format!("{}-two", config.node_id);
    let _two = env.start(registry(), config);
    // A's first call is on the wire and the nodes have taken up A's others.
    assert!(wait_until(WAIT, || async { !env.provider.requests().is_empty() }).await);
    tokio::time::sleep(Duration::from_millis(300)).await;
    for i in 0..5 {
        submit_as(b, job(format!("b-{i}"), "other-model")).await;
    }
    let b_done = wait_until(WAIT, || async {
        env.sql("SELECT count(*) AS n FROM jobs WHERE id LIKE 'b-%' AND state = 'acked'")
            .await[0]["n"]
            == json!(5)
    })
    .await;
    assert!(b_done, "B's jobs are acked");
    let a_acked = env
        .sql("SELECT count(*) AS n FROM jobs WHERE id LIKE 'a-%' AND state = 'acked'")
        .await[0]["n"]
        .as_i64()
        .unwrap();
    // B's calls take 1 s too: 3 leaves a loaded machine a second of slack,
    // and a node whose room A's waiting jobs fill lets 5 or more go first.
    assert!(a_acked <= 3, "B waited for {a_acked} of A's jobs");
    let parked = env
        .sql(
            "SELECT count(*) AS n FROM jobs WHERE waiting->>'kind' = 'provider' \
             AND waiting->>'key' = 'openai/slow-model' AND lease_owner IS NULL",
        )
        .await[0]["n"]
        .as_i64()
        .unwrap_or(0);
    assert!(
        parked > 10,
        "A's jobs wait for the slot holding no lease ({parked})"
    );
    let peaks = env
        .provider
        .peak_concurrency_by(|r| job_of(r).starts_with("a-").then(|| "slow-model".to_owned()));
    assert_eq!(peaks.get("slow-model"), Some(&1), "A's calls never overlap");
    for i in 0..5 {
        assert_eq!(env.provider.requests_for(&format!("job:b-{i}:generate")), 1);
    }
}

/// Per-key concurrency when another node takes over: a `serve` node is
/// SIGKILLed while it holds a slot of a key (limit 2) and stays dead; the
/// other node (its own node id: no reclaim of its own slots) takes the
/// dead node's job over once its lease lapsed, in the slot it held. Every
/// job is acked, each model answer paid once, never more than 2 calls of
/// the key at once, and the dead node's job ended on the other node.
#[actix_rt::test]
async fn a_concurrency_key_holds_when_another_node_takes_over() {
    use crate::support::ServeProcess;
    let env = TestEnv::new().await;
    env.provider.set_latency(Duration::from_millis(300));
    let t = keyed_tenant(&env, "tenant-t").await;
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("serve.log");
    let vars = |name: &str| node_vars(&env, name, Some("3000"));
    let mut dying = ServeProcess::start(&vars("dying"), &log).await;
    let mut keyed = std::collections::HashSet::new();
    for i in 0..10 {
        let id = format!("k-{i}");
        submit(&env, t, &id, Some("conv-1")).await;
        keyed.insert(id);
    }
    assert!(
        wait_until(WAIT, || holds(&env, "dying", "key_slot")).await,
        "the node holds a slot of the key before the kill"
    );
    dying.sigkill();
    let orphaned: Vec<String> = env
        .sql("SELECT id FROM jobs WHERE lease_owner = 'dying' AND key_slot IS NOT NULL")
        .await
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["id"].as_str().unwrap().to_owned())
        .collect();
    assert!(!orphaned.is_empty(), "the dead node held a job of the key");
    let _steady = ServeProcess::start(&vars("steady"), &log).await;
    assert!(
        all_acked(&env, 10).await,
        "every job is acked; log:\n{}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    for id in &orphaned {
        let last = env.job(id).await.history.last().unwrap().worker.clone();
        assert_eq!(last, "steady", "{id} ended on the node that took it over");
    }
    for i in 0..10 {
        let key = format!("job:k-{i}:generate");
        assert_eq!(env.provider.work_done(&key), 1, "{key} paid once");
    }
    let peak = peak_jobs_at_once(&env, |job| keyed.contains(job));
    assert!(
        (1..=2).contains(&peak),
        "at most 2 jobs of the key at the provider at once through the takeover: {peak}"
    );
}

/// The most jobs (of those `counted`) that had a call open at the provider
/// at once. A job's calls count as one: a request whose attempt was dropped
/// (a killed node's, or one stopped by a takeover), which the provider may
/// still be answering or never answers (its client is gone), ends for this
/// count when the same job's last request is answered — a repeat under the
/// job's key is the at-least-once the design accepts, not a second job in
/// the key's slots.
fn peak_jobs_at_once(env: &TestEnv, counted: impl Fn(&String) -> bool) -> usize {
    peak_jobs_by(env, |job| counted(&job.to_owned()).then(String::new))
        .into_values()
        .max()
        .unwrap_or(0)
}

/// [`peak_jobs_at_once`] within each group `group` names (`None`: none).
fn peak_jobs_by(env: &TestEnv, group: impl Fn(&str) -> Option<String>) -> HashMap<String, usize> {
    type Calls = Vec<(std::time::Instant, Option<std::time::Instant>)>;
    let mut by_job: HashMap<(String, String), Calls> = HashMap::new();
    for r in env.provider.requests().iter().filter(|r| !r.throttled) {
        let job = job_of(r);
        if let Some(g) = group(&job) {
            by_job
                .entry((g, job))
                .or_default()
                .push((r.received_at, r.answered_at));
        }
    }
    let mut edges: HashMap<String, Vec<(std::time::Instant, i32)>> = HashMap::new();
    for ((g, _), mut calls) in by_job {
        calls.sort();
        let (first, last) = (calls[0].0, calls[calls.len() - 1]);
        // Each job's calls end with its last one's answer.
        let end = last.1.unwrap_or(last.0);
        let e = edges.entry(g).or_default();
        e.push((first, 1));
        e.push((end.max(first), -1));
    }
    edges
        .into_iter()
        .map(|(g, mut e)| {
            // Ends before starts at the same instant: touching is not overlapping.
            e.sort();
            let (mut now, mut peak) = (0i32, 0i32);
            for (_, d) in e {
                now += d;
                peak = peak.max(now);
            }
            (g, peak as usize)
        })
        .collect()
}

/// A throttled key when another node takes over: the node running a job
/// of a key throttled to 4 starts an hour is SIGKILLed and stays dead; the
/// other node takes its job over after the lease, without a new start.
/// Exactly 4 of the key's 8 jobs reach the provider, each paid once.
#[actix_rt::test]
async fn a_key_throttle_holds_when_another_node_takes_over() {
    use crate::support::ServeProcess;
    let env = TestEnv::new().await;
    env.provider.set_latency(Duration::from_millis(1500));
    let t = throttled_tenant(&env, "tenant-t", 4, 3600).await;
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("serve.log");
    let vars = |name: &str| node_vars(&env, name, None);
    let mut dying = ServeProcess::start(&vars("dying"), &log).await;
    for i in 0..8 {
        submit(&env, t, &format!("k-{i}"), Some("conv-1")).await;
    }
    assert!(
        wait_until(WAIT, || holds(&env, "dying", "throttle_slot")).await,
        "the node runs a throttled job before the kill"
    );
    // Killed at once (a slow start of the other node would let it finish
    // its jobs first), then the other node comes up to take over.
    dying.sigkill();
    let orphaned: Vec<String> = env
        .sql("SELECT id FROM jobs WHERE lease_owner = 'dying' AND throttle_slot IS NOT NULL")
        .await
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["id"].as_str().unwrap().to_owned())
        .collect();
    let _steady = ServeProcess::start(&vars("steady"), &log).await;
    assert!(!orphaned.is_empty(), "the dead node held a started job");
    assert!(
        all_acked(&env, 4).await,
        "the 4 started are acked, the dead node's by the other; log:\n{}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    let sent = jobs_sent(&env, "k-");
    assert_eq!(sent.len(), 4, "4 starts in the hour: {sent:?}");
    for id in &sent {
        let key = format!("job:{id}:generate");
        assert_eq!(env.provider.work_done(&key), 1, "{key} paid once");
    }
    for id in &orphaned {
        let last = env.job(id).await.history.last().unwrap().worker.clone();
        assert_eq!(last, "steady", "{id} ended on the node that took it over");
    }
    let stamped = env
        .sql("SELECT count(*) AS n FROM jobs WHERE throttle_slot IS NOT NULL")
        .await[0]["n"]
        .clone();
    assert_eq!(stamped, 4, "4 start slots taken");
}
