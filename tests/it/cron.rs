//! Schedules (`/v1/schedules`): a cron creates the job
//! `{schedule id}:{YYYYMMDDTHHMMSSZ}` once per fire time, across nodes and
//! through kill -9; nothing fires after a pause or a delete; missed fire
//! times follow `catch_up`.

use std::collections::BTreeSet;
use std::time::Duration;

use chrono::{DateTime, Timelike, Utc};
use onceflow_engine::api::Auth;
use onceflow_engine::testkit::{wait_until, TestEnv};
use onceflow_engine::Registry;
use serde_json::{json, Value};

use crate::support::client;

fn registry() -> Registry {
    let mut r = Registry::new();
    r.register(onceflow_workflows::Completion::default());
    r
}

fn api(env: &TestEnv, auth: Auth) -> String {
    crate::support::serve_api_with_auth(env, registry(), auth)
}

pub(crate) async fn call(
    method: reqwest::Method,
    url: &str,
    token: Option<&str>,
    body: Option<&Value>,
) -> (u16, Value) {
    let mut r = client().request(method, url);
    if let Some(t) = token {
        r = r.bearer_auth(t);
    }
    if let Some(b) = body {
        r = r
            .header("content-type", "application/json")
            .body(serde_json::to_vec(b).unwrap());
    }
    let r = r.send().await.expect("request");
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

fn schedule(id: &str, cron: &str, webhook: &str) -> Value {
    json!({
        "id": id, "cron": cron, "workflow": "completion", "webhook_url": webhook,
        "input": { "model": "m", "messages": [{ "role": "user", "content": "digest" }] },
    })
}

/// The fire times of schedule `id`'s jobs (from their ids), and how many jobs.
async fn fired(env: &TestEnv, id: &str) -> Vec<DateTime<Utc>> {
    let rows = env
        .sql(&format!(
            "SELECT id FROM jobs WHERE id LIKE '{id}:%' ORDER BY id"
        ))
        .await;
    rows.as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let stamp = r["id"].as_str().unwrap().rsplit(':').next().unwrap();
            chrono::NaiveDateTime::parse_from_str(stamp, "%Y%m%dT%H%M%SZ")
                .unwrap()
                .and_utc()
        })
        .collect()
}

/// Creates schedule `id` for token `owner` through the store (past the
/// API's bounds): every second, catching up every missed fire time.
async fn every_second(env: &TestEnv, id: &str, owner: i64) {
    let table = onceflow_engine::rules::schedule::Timetable::parse("* * * * * *", "UTC").unwrap();
    let new = onceflow_engine::store::schedules::NewSchedule {
        id: id.into(),
        cron: "* * * * * *".into(),
        timezone: "UTC".into(),
        workflow: "completion".into(),
        input: json!({ "model": "m", "messages": [{ "role": "user", "content": "tick" }] }),
        webhook_url: env.consumer.url(),
        catch_up: onceflow_engine::rules::schedule::CatchUp::All,
    };
    env.store
        .schedules()
        .create(&new, &table, Some(owner), None)
        .await
        .unwrap();
}

/// Creates schedule `tick` through the API at `url`: every second,
/// catching up every missed fire time.
async fn create_tick(env: &TestEnv, url: &str) {
    let mut body = schedule("tick", "* * * * * *", &env.consumer.url());
    body["catch_up"] = json!("all");
    let (status, answer) = call(reqwest::Method::POST, url, None, Some(&body)).await;
    assert_eq!(status, 201, "{answer}");
}

/// Pauses schedule `tick` once it fired `n` times (within `within`).
async fn pause_after(env: &TestEnv, url: &str, n: usize, within: Duration) {
    assert!(
        wait_until(within, || async { fired(env, "tick").await.len() >= n }).await,
        "the schedule did not fire {n} times"
    );
    let (status, _) = call(
        reqwest::Method::POST,
        &format!("{url}/tick/pause"),
        None,
        None,
    )
    .await;
    assert_eq!(status, 200);
}

/// Job `id` was created once: its first incarnation, one `received` row.
async fn assert_created_once(env: &TestEnv, id: &str) {
    let job = env.job(id).await;
    assert_eq!(job.incarnation, 1, "{id} was created again");
    let received = job
        .history
        .iter()
        .filter(|h| h.state == onceflow_engine::JobState::Received && h.attempt == 0)
        .count();
    assert_eq!(received, 1, "{id}: {:?}", job.history);
}

#[actix_rt::test]
async fn the_schedule_api_answers_each_case_with_its_status() {
    let env = TestEnv::new().await;
    let base = api(&env, Auth::Tokens { loopback: false });
    let alice = env.store.tokens().create("alice", false).await.unwrap();
    let bob = env.store.tokens().create("bob", false).await.unwrap();
    let url = format!("{base}/v1/schedules");
    let body = schedule("digest", "0 2 * * *", &env.consumer.url());
    let post = reqwest::Method::POST;

    let (status, created) = call(post.clone(), &url, Some(&alice), Some(&body)).await;
    assert_eq!(status, 201, "{created}");
    assert_eq!(created["catch_up"], "latest");
    assert_eq!(created["timezone"], "UTC");
    let next: DateTime<Utc> = created["next_fire_at"].as_str().unwrap().parse().unwrap();
    assert_eq!((next.hour(), next.minute(), next.second()), (2, 0, 0));
    assert!(next > Utc::now());
    let (status, _) = call(post.clone(), &url, Some(&alice), Some(&body)).await;
    assert_eq!(status, 200, "the identical schedule again");
    let mut other = body.clone();
    other["cron"] = json!("0 3 * * *");
    let (status, answer) = call(post.clone(), &url, Some(&alice), Some(&other)).await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (409, Some("schedule_conflict"))
    );
    let (status, _) = call(post.clone(), &url, Some(&bob), Some(&body)).await;
    assert_eq!(status, 409, "another token's id is taken too");

    for (field, value, named) in [
        ("cron", json!("0 2 * *"), "cron"),
        ("cron", json!("0 2 * * * * 2027"), "cron"),
        ("cron", json!("every night"), "cron"),
        ("timezone", json!("Mars/Olympus"), "timezone"),
        ("catch_up", json!("sometimes"), "catch_up"),
        ("workflow", json!("nope"), "workflow"),
        ("input", json!({ "messages": "hi" }), "input"),
        ("id", json!("a:b"), "id"),
        ("surprise", json!(1), "surprise"),
    ] {
        let mut bad = body.clone();
        bad["id"] = json!("bad-one");
        bad[field] = value;
        let (status, answer) = call(post.clone(), &url, Some(&alice), Some(&bad)).await;
        assert_eq!(status, 422, "{field}: {answer}");
        assert!(
            answer["error"]["field"]
                .as_str()
                .is_some_and(|f| f.starts_with(named)),
            "{field}: {answer}"
        );
    }

    // A job id of a schedule's form is the schedule's alone.
    let mut job = body.clone();
    job.as_object_mut().unwrap().remove("cron");
    job["id"] = json!("digest:20261205T020000Z");
    let (status, answer) = call(
        post.clone(),
        &format!("{base}/v1/jobs"),
        Some(&bob),
        Some(&job),
    )
    .await;
    assert_eq!(
        (status, answer["error"]["field"].as_str()),
        (422, Some("id")),
        "{answer}"
    );

    // Listed and shown to its token only.
    let (status, list) = call(reqwest::Method::GET, &url, Some(&alice), None).await;
    assert_eq!(status, 200);
    assert_eq!(list["schedules"].as_array().unwrap().len(), 1);
    let (_, list) = call(reqwest::Method::GET, &url, Some(&bob), None).await;
    assert_eq!(list["schedules"], json!([]));
    let one = format!("{url}/digest");
    let (status, shown) = call(reqwest::Method::GET, &one, Some(&alice), None).await;
    assert_eq!(status, 200);
    assert_eq!(shown["latest_jobs"], json!([]));
    let (status, _) = call(reqwest::Method::GET, &one, Some(&bob), None).await;
    assert_eq!(status, 404);

    let (status, paused) = call(post.clone(), &format!("{one}/pause"), Some(&alice), None).await;
    assert_eq!((status, paused["paused"].as_bool()), (200, Some(true)));
    assert_eq!(paused["next_fire_at"], Value::Null);
    let (status, resumed) = call(post.clone(), &format!("{one}/resume"), Some(&alice), None).await;
    assert_eq!((status, resumed["paused"].as_bool()), (200, Some(false)));
    assert!(resumed["next_fire_at"].is_string());
    let (status, _) = call(post.clone(), &format!("{one}/pause"), Some(&bob), None).await;
    assert_eq!(status, 404);
    let (status, _) = call(reqwest::Method::DELETE, &one, Some(&bob), None).await;
    assert_eq!(status, 404);
    let (status, _) = call(reqwest::Method::DELETE, &one, Some(&alice), None).await;
    assert_eq!(status, 204);
    let (status, _) = call(reqwest::Method::GET, &one, Some(&alice), None).await;
    assert_eq!(status, 404);
}

/// A schedule created while a firing runs fires: the node's first firing
/// is held after it read that no schedule is active, the schedule is
/// created meanwhile (its `NOTIFY` arrives during the firing), and the
/// firing's stale "none active" must not be the last word.
#[actix_rt::test]
async fn a_schedule_created_during_a_firing_fires() {
    use onceflow_engine::faults::{Action, FailPoint};
    use onceflow_engine::node::supervisor::SCHEDULES_FAULT_ID;
    let env = TestEnv::new().await;
    let base = api(&env, Auth::Off);
    env.faults.arm(
        Some(SCHEDULES_FAULT_ID),
        FailPoint::AfterCommit("schedules"),
        Action::Stall(Duration::from_secs(3)),
        1,
    );
    let _node = env.start(registry(), env.config());
    assert!(
        wait_until(Duration::from_secs(10), || async {
            env.faults.fired(SCHEDULES_FAULT_ID)
        })
        .await,
        "the firing was never held"
    );
    // LISTEN is connected by now: the NOTIFY reaches the held node.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let body = schedule("late", "* * * * * *", &env.consumer.url());
    let (status, answer) = call(
        reqwest::Method::POST,
        &format!("{base}/v1/schedules"),
        None,
        Some(&body),
    )
    .await;
    assert_eq!(status, 201, "{answer}");
    assert!(
        wait_until(Duration::from_secs(10), || async {
            fired(&env, "late").await.len() >= 2
        })
        .await,
        "a schedule created during a firing never fired"
    );
}

/// A tenant's schedules are bounded: the cron's length, how often it
/// fires (an admin's may fire every second), and how many a token has;
/// the list pages with a cursor and refuses an unknown parameter.
#[actix_rt::test]
async fn a_tenants_schedules_are_bounded() {
    let env = TestEnv::new().await;
    let base = api(&env, Auth::Tokens { loopback: false });
    let alice = env.store.tokens().create("alice", false).await.unwrap();
    let admin = env.store.tokens().create("root", true).await.unwrap();
    let url = format!("{base}/v1/schedules");
    let post = reqwest::Method::POST;
    let hook = env.consumer.url();
    let long = format!("0 2 * * {}", "1,".repeat(150_000));
    for cron in [long.as_str(), "* * * * * *", "*/30 * * * * *"] {
        let (status, answer) = call(
            post.clone(),
            &url,
            Some(&alice),
            Some(&schedule("fast", cron, &hook)),
        )
        .await;
        assert_eq!(
            (status, answer["error"]["field"].as_str()),
            (422, Some("cron")),
            "{answer}"
        );
    }
    let (status, answer) = call(
        post.clone(),
        &url,
        Some(&admin),
        Some(&schedule("root-tick", "0 0 1 1 *", &hook)),
    )
    .await;
    assert_eq!(status, 201, "{answer}");
    let (status, answer) = call(
        post.clone(),
        &url,
        Some(&admin),
        Some(&schedule("root-fast", "* * * * * *", &hook)),
    )
    .await;
    assert_eq!(status, 201, "an admin's may fire every second: {answer}");
    call(
        reqwest::Method::POST,
        &format!("{url}/root-fast/pause"),
        Some(&admin),
        None,
    )
    .await;
    for i in 0..100 {
        let (status, answer) = call(
            post.clone(),
            &url,
            Some(&alice),
            Some(&schedule(&format!("s-{i:03}"), "0 2 * * *", &hook)),
        )
        .await;
        assert_eq!(status, 201, "{i}: {answer}");
    }
    let (status, answer) = call(
        post.clone(),
        &url,
        Some(&alice),
        Some(&schedule("s-100", "0 2 * * *", &hook)),
    )
    .await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (409, Some("too_many_schedules")),
        "{answer}"
    );
    let (status, _) = call(
        post.clone(),
        &url,
        Some(&alice),
        Some(&schedule("s-007", "0 2 * * *", &hook)),
    )
    .await;
    assert_eq!(status, 200, "the identical schedule again is still found");
    let mut ids = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let page_url = match &cursor {
            Some(c) => format!("{url}?limit=40&cursor={c}"),
            None => format!("{url}?limit=40"),
        };
        let (status, page) = call(reqwest::Method::GET, &page_url, Some(&alice), None).await;
        assert_eq!(status, 200, "{page}");
        for s in page["schedules"].as_array().unwrap() {
            ids.push(s["id"].as_str().unwrap().to_owned());
        }
        match page["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_owned()),
            None => break,
        }
    }
    let expected: Vec<String> = (0..100).map(|i| format!("s-{i:03}")).collect();
    assert_eq!(
        ids, expected,
        "every schedule once, in order, none of the admin's"
    );
    let (_, all) = call(reqwest::Method::GET, &url, Some(&admin), None).await;
    assert_eq!(
        all["schedules"].as_array().unwrap().len(),
        102,
        "an admin token lists every token's"
    );
    for bad in ["?tag=x", "?limit=0", "?limit=1.5"] {
        let (status, answer) = call(
            reqwest::Method::GET,
            &format!("{url}{bad}"),
            Some(&alice),
            None,
        )
        .await;
        assert_eq!(status, 422, "{bad}: {answer}");
    }
}

/// A schedule's fired jobs count against its token's backlog: with room
/// for 3 unfinished jobs, a schedule firing every second makes 3 jobs while
/// they run, and its other fire times are recorded `skipped`
/// (`backlog_full`) and shown in its latest jobs.
#[actix_rt::test]
async fn a_fired_job_counts_against_its_tokens_backlog() {
    let env = TestEnv::new().await;
    env.provider.set_latency(Duration::from_secs(30));
    let alice = env.store.tokens().create("alice", false).await.unwrap();
    let owner = env
        .store
        .tokens()
        .authenticate(&alice)
        .await
        .unwrap()
        .unwrap()
        .token;
    let mut config = env.config();
    config.provider.timeout = Duration::from_secs(60);
    config.max_backlog_per_token = Some(3);
    let _node = env.start(registry(), config);
    every_second(&env, "busy", owner).await;
    let skipped = "SELECT count(*) AS n FROM schedule_fires WHERE skipped = 'backlog_full'";
    assert!(
        wait_until(Duration::from_secs(15), || async {
            env.sql(skipped).await[0]["n"].as_i64().unwrap() >= 3
        })
        .await,
        "no fire time was skipped: {}",
        env.sql("SELECT * FROM schedule_fires").await
    );
    assert_eq!(
        fired(&env, "busy").await.len(),
        3,
        "3 jobs, then none while they run"
    );
    let shown = env.store.schedules().get("busy").await.unwrap().unwrap();
    assert!(
        shown
            .latest_jobs
            .iter()
            .any(|j| j.skipped.as_deref() == Some("backlog_full") && j.state.is_none()),
        "{:?}",
        shown.latest_jobs
    );
}

/// A revoked token's schedules stop firing: nothing fires more than a
/// second after the revoke, while another token's schedule, due at the
/// same moments, goes on firing (the firing statement runs for it, and
/// must leave the revoked one out itself).
#[actix_rt::test]
async fn a_revoked_tokens_schedules_stop_firing() {
    let env = TestEnv::new().await;
    let id_of = |token: String| {
        let env = &env;
        async move {
            env.store
                .tokens()
                .authenticate(&token)
                .await
                .unwrap()
                .unwrap()
                .token
        }
    };
    let alice = env.store.tokens().create("alice", false).await.unwrap();
    let owner = id_of(alice).await;
    let bob = env.store.tokens().create("bob", false).await.unwrap();
    let other = id_of(bob).await;
    let _node = env.start(registry(), env.config());
    every_second(&env, "gone", owner).await;
    every_second(&env, "kept", other).await;
    assert!(
        wait_until(Duration::from_secs(10), || async {
            fired(&env, "gone").await.len() >= 2
        })
        .await,
        "the schedule fires"
    );
    assert!(env.store.tokens().revoke("alice").await.unwrap());
    let revoked = Utc::now();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let late: Vec<_> = fired(&env, "gone")
        .await
        .into_iter()
        .filter(|t| *t > revoked + chrono::Duration::seconds(1))
        .collect();
    assert!(late.is_empty(), "fired after the revoke: {late:?}");
    let kept_on = wait_until(Duration::from_secs(20), || async {
        fired(&env, "kept")
            .await
            .into_iter()
            .any(|t| t > revoked + chrono::Duration::seconds(1))
    })
    .await;
    assert!(kept_on, "the live token's schedule fired on");
}

/// A schedule firing every second on two nodes: each fire time is one job,
/// none is skipped, each job calls the model once and sends one webhook;
/// nothing fires after a pause, or after a delete.
#[actix_rt::test]
async fn each_fire_time_is_one_job_across_two_nodes_and_none_after_pause_or_delete() {
    let env = TestEnv::new().await;
    let base = api(&env, Auth::Off);
    let mut config = env.config();
    config.node_id = "node-a".into();
    let _a = env.start(registry(), config.clone());
    config.node_id = "node-b".into();
    let _b = env.start(registry(), config);
    let url = format!("{base}/v1/schedules");
    // Catching up everything: a fire time of the pause that fired after the
    // resume would show.
    create_tick(&env, &url).await;
    pause_after(&env, &url, 5, Duration::from_secs(20)).await;
    let at_pause = fired(&env, "tick").await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let times = fired(&env, "tick").await;
    assert_eq!(times, at_pause, "nothing fired after the pause");
    // One job per second, none skipped.
    for pair in times.windows(2) {
        assert_eq!(pair[1] - pair[0], chrono::Duration::seconds(1), "{times:?}");
    }
    let ids: Vec<String> = times
        .iter()
        .map(|t| onceflow_engine::rules::schedule::job_id("tick", *t))
        .collect();
    for id in &ids {
        env.wait_for(
            id,
            onceflow_engine::JobState::Acked,
            Duration::from_secs(20),
        )
        .await;
        // No crash here: exactly one request each reached the fakes.
        assert_eq!(
            env.provider.requests_for(&format!("job:{id}:generate")),
            1,
            "{id}"
        );
        assert_eq!(env.consumer.deliveries_for(id).len(), 1, "{id}");
        assert_eq!(env.consumer.processed_for(id), 1, "{id}");
        assert_created_once(&env, id).await;
    }
    let fires = env
        .sql("SELECT count(*) AS n FROM schedule_fires WHERE schedule_id = 'tick'")
        .await;
    assert_eq!(fires[0]["n"], ids.len(), "each fire time recorded once");
    let (_, shown) = call(reqwest::Method::GET, &format!("{url}/tick"), None, None).await;
    assert_eq!(shown["latest_jobs"][0]["id"], json!(ids.last().unwrap()));
    assert_eq!(shown["latest_jobs"][0]["state"], "acked");

    // Resumed, then deleted: nothing after the delete.
    call(
        reqwest::Method::POST,
        &format!("{url}/tick/resume"),
        None,
        None,
    )
    .await;
    assert!(
        wait_until(Duration::from_secs(10), || async {
            fired(&env, "tick").await.len() > times.len()
        })
        .await,
        "the resumed schedule did not fire"
    );
    let (status, _) = call(reqwest::Method::DELETE, &format!("{url}/tick"), None, None).await;
    assert_eq!(status, 204);
    let at_delete = fired(&env, "tick").await;
    assert!(
        at_delete.len() > times.len(),
        "its jobs stay after the delete: {at_delete:?}"
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        fired(&env, "tick").await,
        at_delete,
        "nothing fired after the delete"
    );
    // The fire times skipped while paused never fired.
    let resumed: BTreeSet<_> = at_delete
        .iter()
        .filter(|t| **t > *times.last().unwrap())
        .collect();
    assert!(
        resumed
            .iter()
            .all(|t| **t - *times.last().unwrap() > chrono::Duration::seconds(2)),
        "a fire time of the pause fired: {resumed:?}"
    );
}

/// Fire times missed while no node ran: `all` fires each, `latest` only the
/// last, `none` none.
#[actix_rt::test]
async fn missed_fire_times_follow_catch_up() {
    let env = TestEnv::new().await;
    let base = api(&env, Auth::Off);
    let url = format!("{base}/v1/schedules");
    // Hourly at a minute half an hour from now, so the latest missed fire
    // time is about 30 minutes old, never "on time".
    let now = Utc::now();
    let minute = (now.minute() + 30) % 60;
    let mut last = now
        .with_minute(minute)
        .unwrap()
        .with_second(0)
        .unwrap()
        .with_nanosecond(0)
        .unwrap();
    if last > now {
        last -= chrono::Duration::hours(1);
    }
    let first = last - chrono::Duration::hours(3);
    for mode in ["all", "latest", "none"] {
        let mut body = schedule(
            &format!("missed-{mode}"),
            &format!("{minute} * * * *"),
            &env.consumer.url(),
        );
        body["catch_up"] = json!(mode);
        let (status, answer) = call(reqwest::Method::POST, &url, None, Some(&body)).await;
        assert_eq!(status, 201, "{answer}");
    }
    // As if no node had run for three hours and more.
    {
        use diesel_async::RunQueryDsl;
        let mut conn = env.store.db().conn().await.unwrap();
        let moved = diesel::sql_query("UPDATE schedules SET next_fire_at = $1")
            .bind::<diesel::sql_types::Timestamptz, _>(first)
            .execute(&mut conn)
            .await
            .unwrap();
        assert_eq!(moved, 3);
    }
    let _engine = env.start(registry(), env.config());
    assert!(
        wait_until(Duration::from_secs(20), || async {
            fired(&env, "missed-all").await.len() == 4
                && fired(&env, "missed-latest").await.len() == 1
        })
        .await,
        "all: {:?}, latest: {:?}",
        fired(&env, "missed-all").await,
        fired(&env, "missed-latest").await
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    let hours: Vec<_> = (0..4).map(|h| first + chrono::Duration::hours(h)).collect();
    assert_eq!(fired(&env, "missed-all").await, hours);
    assert_eq!(fired(&env, "missed-latest").await, vec![last]);
    assert_eq!(
        fired(&env, "missed-none").await,
        Vec::<DateTime<Utc>>::new()
    );
    // Each moved on to its next fire time after now.
    let next = env
        .sql("SELECT next_fire_at > now() AS ahead FROM schedules")
        .await;
    assert!(
        next.as_array().unwrap().iter().all(|r| r["ahead"] == true),
        "{next}"
    );
}

/// `onceflow serve` firing a schedule every second is killed with SIGKILL
/// and started again three seconds later: with `catch_up: "all"`, every
/// fire time, those of the outage included, is one job, and each job
/// called the model once and sent one webhook.
#[actix_rt::test]
async fn no_fire_time_is_lost_or_doubled_through_kill_9() {
    use crate::support::ServeProcess;
    let env = TestEnv::new().await;
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("serve.log");
    let vars = [
        ("DATABASE_URL", env.db_url.clone()),
        ("OPENAI_BASE_URL", env.provider.base_url()),
        ("ONCEFLOW_POLL_MS", "100".to_owned()),
        ("ONCEFLOW_LEASE_MS", "1000".to_owned()),
        // A tenant's schedule every second (60 s at the least by default).
        ("ONCEFLOW_MIN_SCHEDULE_INTERVAL", "1s".to_owned()),
    ];
    let mut serve = ServeProcess::start(&vars, &log).await;
    let token = env.store.tokens().create("cron", false).await.unwrap();
    let url = format!("{}/v1/schedules", serve.base);
    let mut body = schedule("beat", "* * * * * *", &env.consumer.url());
    body["catch_up"] = json!("all");
    let (status, answer) = call(reqwest::Method::POST, &url, Some(&token), Some(&body)).await;
    assert_eq!(status, 201, "{answer}");
    assert!(
        wait_until(Duration::from_secs(20), || async {
            fired(&env, "beat").await.len() >= 3
        })
        .await,
        "the schedule did not fire"
    );
    serve.sigkill();
    let killed_at = Utc::now();
    tokio::time::sleep(Duration::from_secs(3)).await;
    serve.restart_on_same_port(&vars, &log).await;
    assert!(
        wait_until(Duration::from_secs(20), || async {
            fired(&env, "beat")
                .await
                .last()
                .is_some_and(|t| *t > killed_at + chrono::Duration::seconds(4))
        })
        .await,
        "the restarted node did not fire"
    );
    let (status, _) = call(
        reqwest::Method::POST,
        &format!("{url}/beat/pause"),
        Some(&token),
        None,
    )
    .await;
    assert_eq!(status, 200);
    let times = fired(&env, "beat").await;
    let owner = env
        .store
        .tokens()
        .list()
        .await
        .unwrap()
        .into_iter()
        .find(|t| t.name == "cron")
        .unwrap()
        .id;
    for pair in times.windows(2) {
        assert_eq!(
            pair[1] - pair[0],
            chrono::Duration::seconds(1),
            "a fire time lost: {times:?}"
        );
    }
    assert!(
        times
            .iter()
            .any(|t| *t > killed_at + chrono::Duration::seconds(1)
                && *t < killed_at + chrono::Duration::seconds(3)),
        "the outage's fire times were caught up: {times:?}"
    );
    for t in &times {
        let id = onceflow_engine::rules::schedule::job_id("beat", *t);
        env.wait_for(
            &id,
            onceflow_engine::JobState::Acked,
            Duration::from_secs(30),
        )
        .await;
        assert_eq!(
            env.provider.work_done(&format!("job:{id}:generate")),
            1,
            "{id}"
        );
        assert_eq!(env.consumer.processed_for(&id), 1, "{id}");
        let job = env.job(&id).await;
        assert_eq!(
            job.owner_token,
            Some(owner),
            "{id} belongs to the schedule's token"
        );
        assert_created_once(&env, &id).await;
    }
}

/// `onceflow schedule create|list|show|pause|resume|delete` against a
/// running server, as an operator types them.
#[actix_rt::test]
async fn the_schedule_cli_creates_lists_pauses_and_deletes() {
    let env = TestEnv::new().await;
    let base = api(&env, Auth::Off);
    // Run off the test's thread: the store's tasks live on it.
    let cli = |args: &[&str]| {
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_onceflow"));
        command
            .arg("schedule")
            .args(args)
            .args(["--server", &base])
            .env_remove("ONCEFLOW_TOKEN");
        async move {
            let out = tokio::task::spawn_blocking(move || {
                command.output().expect("run onceflow schedule")
            })
            .await
            .unwrap();
            (
                out.status.success(),
                String::from_utf8_lossy(&out.stdout).into_owned()
                    + &String::from_utf8_lossy(&out.stderr),
            )
        }
    };
    let input = r#"{"model": "m", "messages": [{"role": "user", "content": "digest"}]}"#;
    let hook = env.consumer.url();
    let create = [
        "create",
        "--id",
        "nightly",
        "--cron",
        "0 2 * * *",
        "--timezone",
        "Europe/Paris",
        "--workflow",
        "completion",
        "--input",
        input,
        "--webhook-url",
        &hook,
    ];
    let (ok, out) = cli(&create).await;
    assert!(ok && out.contains("schedule nightly created"), "{out}");
    let (ok, out) = cli(&create).await;
    assert!(ok && out.contains("already existed"), "{out}");
    let (ok, out) = cli(&[
        "create",
        "--id",
        "bad",
        "--cron",
        "0 2 * *",
        "--workflow",
        "completion",
        "--input",
        input,
        "--webhook-url",
        &hook,
    ])
    .await;
    assert!(!ok && out.contains("422 invalid cron"), "{out}");
    let (ok, out) = cli(&["list"]).await;
    assert!(
        ok && out.contains("nightly") && out.contains("Europe/Paris"),
        "{out}"
    );
    let (ok, out) = cli(&["pause", "nightly"]).await;
    assert!(ok && out.contains("paused"), "{out}");
    let (_, out) = cli(&["show", "nightly"]).await;
    assert!(out.contains("paused"), "{out}");
    let (ok, out) = cli(&["resume", "nightly"]).await;
    assert!(ok && out.contains("next fire at"), "{out}");
    let (ok, _) = cli(&["delete", "nightly"]).await;
    assert!(ok);
    let (ok, out) = cli(&["show", "nightly"]).await;
    assert!(!ok && out.contains("404"), "{out}");
}

/// A schedule's view lists its latest ten jobs, newest first; a fire time
/// recorded once never makes a job again, even after its job was purged
/// and the schedule is made to walk over that time again (a job purged
/// shows `state: null`).
#[actix_rt::test]
async fn the_latest_ten_are_listed_and_a_purged_fire_time_never_fires_again() {
    let env = TestEnv::new().await;
    let base = api(&env, Auth::Off);
    let url = format!("{base}/v1/schedules");
    create_tick(&env, &url).await;
    let engine = env.start(registry(), env.config());
    pause_after(&env, &url, 12, Duration::from_secs(30)).await;
    let times = fired(&env, "tick").await;
    for t in &times {
        let id = onceflow_engine::rules::schedule::job_id("tick", *t);
        env.wait_for(
            &id,
            onceflow_engine::JobState::Acked,
            Duration::from_secs(20),
        )
        .await;
    }
    engine.shutdown();
    let (_, shown) = call(reqwest::Method::GET, &format!("{url}/tick"), None, None).await;
    let latest = shown["latest_jobs"].as_array().unwrap().clone();
    let newest: Vec<Value> = times
        .iter()
        .rev()
        .take(10)
        .map(|t| json!(onceflow_engine::rules::schedule::job_id("tick", *t)))
        .collect();
    let listed: Vec<Value> = latest.iter().map(|j| j["id"].clone()).collect();
    assert_eq!(listed, newest, "the latest ten, newest first");

    // Every job purged; the schedule walks over its fire times again.
    let purged = env.store.retention().purge_finished(0, 1000).await.unwrap();
    assert_eq!(purged as usize, times.len(), "every fired job purged");
    {
        use diesel_async::RunQueryDsl;
        let mut conn = env.store.db().conn().await.unwrap();
        diesel::sql_query("UPDATE schedules SET paused = false, next_fire_at = $1")
            .bind::<diesel::sql_types::Timestamptz, _>(times[0])
            .execute(&mut conn)
            .await
            .unwrap();
    }
    let (_, shown) = call(reqwest::Method::GET, &format!("{url}/tick"), None, None).await;
    let states: Vec<Value> = shown["latest_jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["state"].clone())
        .collect();
    assert_eq!(states, vec![Value::Null; 10], "purged jobs show state null");
    let fires_upto = format!(
        "SELECT count(*) AS n FROM schedule_fires WHERE fire_at <= '{}'",
        times.last().unwrap().to_rfc3339()
    );
    let fires_before = env.sql(&fires_upto).await[0]["n"].clone();
    assert_eq!(fires_before, json!(times.len()));
    let _again = env.start(registry(), env.config());
    assert!(
        wait_until(Duration::from_secs(20), || async {
            !fired(&env, "tick").await.is_empty()
        })
        .await,
        "the schedule fires on, for its new fire times"
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    let refired: Vec<_> = fired(&env, "tick")
        .await
        .into_iter()
        .filter(|t| times.contains(t))
        .collect();
    assert!(
        refired.is_empty(),
        "purged fire times fired again: {refired:?}"
    );
    let fires_after = env.sql(&fires_upto).await[0]["n"].clone();
    assert_eq!(fires_after, fires_before, "no fire time recorded twice");
}

/// A token's cap of 100 schedules holds for the cluster under concurrency:
/// 130 creates at once, split between two nodes, make exactly 100 (112
/// before the store counted under the token's lock); the other 30 are
/// `409 too_many_schedules`.
#[actix_rt::test]
async fn concurrent_creates_on_two_nodes_stop_at_the_schedule_cap() {
    let env = TestEnv::new().await;
    let nodes = [
        api(&env, Auth::Tokens { loopback: false }),
        api(&env, Auth::Tokens { loopback: false }),
    ];
    let alice = env.store.tokens().create("alice", false).await.unwrap();
    let hook = env.consumer.url();
    let creates = (0..130).map(|i| {
        let url = format!("{}/v1/schedules", nodes[i % 2]);
        let body = schedule(&format!("cap-{i:03}"), "0 2 * * *", &hook);
        let alice = alice.clone();
        async move {
            let (status, answer) =
                call(reqwest::Method::POST, &url, Some(&alice), Some(&body)).await;
            (status, answer["error"]["code"].as_str().map(str::to_owned))
        }
    });
    let answers = futures_util::future::join_all(creates).await;
    let created = answers.iter().filter(|(s, _)| *s == 201).count();
    let capped = answers
        .iter()
        .filter(|a| **a == (409, Some("too_many_schedules".to_owned())))
        .count();
    assert_eq!((created, capped), (100, 30), "{answers:?}");
    assert_eq!(
        env.sql("SELECT count(*) AS n FROM schedules").await[0]["n"],
        json!(100)
    );
}
