//! The web console in a real browser: Debian's Chromium driven over the W3C
//! WebDriver protocol (chromedriver), against a real `serve`.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use base64::Engine as _;
use onceflow_engine::testkit::{wait_until, Behaviour, TestEnv};
use serde_json::{json, Value};

use crate::support::{client, free_port, ServeProcess};

const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// A chromedriver child and one headless Chromium session in it.
struct Browser {
    driver: Child,
    base: String,
    session: String,
}

impl Browser {
    async fn start() -> Browser {
        let port = free_port();
        let driver = Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("chromedriver (Debian: apt-get install chromium chromium-driver)");
        let base = format!("http://127.0.0.1:{port}");
        let ready = wait_until(Duration::from_secs(20), || async {
            client()
                .get(format!("{base}/status"))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success())
        })
        .await;
        assert!(ready, "chromedriver did not start");
        let caps = json!({ "capabilities": { "alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": "/usr/bin/chromium",
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                         "--disable-background-networking", "--disable-component-update", "--disable-sync",
                         "--no-first-run", "--window-size=1280,1400"]
            }
        }}});
        let answer: Value = client()
            .post(format!("{base}/session"))
            .json(&caps)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let session = answer["value"]["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no WebDriver session: {answer}"))
            .to_owned();
        Browser {
            driver,
            base,
            session,
        }
    }

    async fn call(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Value {
        let url = format!("{}/session/{}{path}", self.base, self.session);
        let mut r = client().request(method, url);
        if let Some(b) = body {
            r = r.json(&b);
        }
        r.send().await.unwrap().json().await.unwrap()
    }

    async fn go(&self, url: &str) {
        self.call(reqwest::Method::POST, "/url", Some(json!({ "url": url })))
            .await;
    }

    /// The element matching `css`, if there is one now.
    async fn find(&self, css: &str) -> Option<String> {
        let v = self
            .call(
                reqwest::Method::POST,
                "/element",
                Some(json!({ "using": "css selector", "value": css })),
            )
            .await;
        v["value"][ELEMENT].as_str().map(str::to_owned)
    }

    async fn text(&self, css: &str) -> Option<String> {
        let id = self.find(css).await?;
        let v = self
            .call(reqwest::Method::GET, &format!("/element/{id}/text"), None)
            .await;
        v["value"].as_str().map(str::to_owned)
    }

    /// Waits until `css` shows text for which `ok` holds.
    async fn wait_text(&self, css: &str, ok: impl Fn(&str) -> bool) -> bool {
        wait_until(Duration::from_secs(20), || async {
            self.text(css).await.is_some_and(|t| ok(&t))
        })
        .await
    }

    async fn click(&self, css: &str) {
        let id = self.find(css).await.unwrap_or_else(|| panic!("no {css}"));
        self.call(
            reqwest::Method::POST,
            &format!("/element/{id}/click"),
            Some(json!({})),
        )
        .await;
    }

    async fn type_into(&self, css: &str, text: &str) {
        let id = self.find(css).await.unwrap_or_else(|| panic!("no {css}"));
        self.call(
            reqwest::Method::POST,
            &format!("/element/{id}/value"),
            Some(json!({ "text": text })),
        )
        .await;
    }

    async fn screenshot(&self, path: &std::path::Path) {
        let v = self.call(reqwest::Method::GET, "/screenshot", None).await;
        let png = base64::engine::general_purpose::STANDARD
            .decode(v["value"].as_str().unwrap())
            .unwrap();
        std::fs::write(path, png).unwrap();
    }

    /// Ends the session, which closes Chromium; killing chromedriver alone
    /// (the fallback in `drop`) leaves the browser running.
    async fn quit(self) {
        let _ = client()
            .delete(format!("{}/session/{}", self.base, self.session))
            .send()
            .await;
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

/// Where the tests' screenshots go (`target/tmp`; docs/ keeps copies).
fn shots() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
}

/// The console asks for a token, lists a job reaching `acked`, shows a dead
/// job's reason, and its redrive button brings that job to `acked` with one
/// delivery at the consumer.
#[actix_rt::test]
async fn the_console_lists_shows_and_redrives_jobs_in_a_real_browser() {
    let env = TestEnv::new().await;
    let dir = tempfile::tempdir().unwrap();
    let serve = ServeProcess::start(
        &[
            ("DATABASE_URL", env.db_url.clone()),
            ("OPENAI_BASE_URL", env.provider.base_url()),
            ("ONCEFLOW_LEASE_MS", "2000".to_owned()),
            ("ONCEFLOW_POLL_MS", "200".to_owned()),
            (
                "ONCEFLOW_TRACE_URL",
                "http://tempo.example/trace/{trace_id}".to_owned(),
            ),
        ],
        &dir.path().join("serve.log"),
    )
    .await;
    let token = env.store.tokens().create("console", true).await.unwrap();
    // A tenant with a daily budget: the header shows what it spent today.
    env.store.tokens().create("budgeted", false).await.unwrap();
    let budget = onceflow_engine::store::tokens::Share {
        daily_token_budget: Some(5000),
        ..Default::default()
    };
    env.store
        .tokens()
        .set_share("budgeted", budget)
        .await
        .unwrap();
    env.consumer
        .push_for("ui-dead", Behaviour::Status(410, None));
    env.consumer
        .push_for("ui-dead-2", Behaviour::Status(410, None));
    for id in ["ui-ok", "ui-dead", "ui-dead-2"] {
        let r = client()
            .post(format!("{}/v1/jobs", serve.base))
            .bearer_auth(&token)
            .json(&json!({
                "id": id, "workflow": "completion", "webhook_url": env.consumer.url(),
                "input": { "model": "m", "messages": [{ "role": "user", "content": id }] },
            }))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 201);
    }

    let browser = Browser::start().await;
    browser.go(&format!("{}/", serve.base)).await;
    // A token exists: the console asks for one.
    if !browser
        .wait_text("#login-title", |t| t == "API token")
        .await
    {
        let found = browser
            .call(
                reqwest::Method::POST,
                "/element",
                Some(json!({ "using": "css selector", "value": "#login-title" })),
            )
            .await;
        panic!("no token form: {found}");
    }
    browser.type_into("#token", &token).await;
    browser.click("#login-form button").await;
    assert!(
        browser
            .wait_text("tr[data-id=\"ui-ok\"] td[data-state]", |t| t == "acked")
            .await,
        "the list shows ui-ok acked"
    );
    assert!(
        browser
            .wait_text("tr[data-id=\"ui-ok\"] td[data-fact=\"token\"]", |t| t
                == "console")
            .await,
        "the list names the token (the tenant) that submitted each job"
    );
    assert!(
        browser
            .wait_text("#budgets li[data-token=\"budgeted\"]", |t| t
                == "budgeted: 0 of 5000 model tokens today")
            .await,
        "the header shows each budget's spend today"
    );
    assert!(
        browser
            .wait_text("a[data-state=\"acked\"]", |t| t == "acked 1")
            .await
    );

    // The dead job's page gives its reason.
    browser.go(&format!("{}/#/jobs/ui-dead", serve.base)).await;
    assert!(
        browser
            .wait_text("dd[data-fact=\"dead reason\"]", |t| t.contains("refused"))
            .await,
        "the dead job's page shows why"
    );
    assert!(
        browser
            .wait_text("dd[data-fact=\"trace id\"] a", |t| t.len() == 32)
            .await
    );
    // Its webhook's sends are in the timeline: one, refused with 410.
    assert!(
        browser
            .wait_text("#timeline tr[data-kind=\"webhook\"]", |t| t
                .contains("1 send, last answer 410"))
            .await,
        "the timeline shows the webhook's send"
    );
    let shots = shots();
    browser
        .screenshot(&shots.join("console-dead-job.png"))
        .await;

    // Redrive from the page.
    browser.type_into("#reason", "consumer fixed").await;
    browser.click("#redrive").await;
    let acked = wait_until(Duration::from_secs(20), || async {
        env.store
            .jobs()
            .get("ui-dead")
            .await
            .ok()
            .flatten()
            .is_some_and(|j| j.state == onceflow_engine::JobState::Acked)
    })
    .await;
    assert!(acked, "the redrive button brought ui-dead to acked");
    assert_eq!(env.consumer.processed_for("ui-dead"), 1, "one delivery");
    assert!(
        browser
            .wait_text("dd[data-fact=\"state\"]", |t| t == "acked")
            .await
    );
    assert!(
        browser.find("#reason[hidden]").await.is_some(),
        "an acked job shows no reason box without a button"
    );
    // The acked job's page shows its input and result, and no stale error.
    browser.go(&format!("{}/#/jobs/ui-ok", serve.base)).await;
    assert!(
        browser
            .wait_text("#job-input", |t| t.contains("\"ui-ok\""))
            .await,
        "the input is shown"
    );
    assert!(
        browser
            .wait_text("#job-result", |t| t.contains("\"content\""))
            .await,
        "the result is shown"
    );
    assert!(browser
        .find("#job-facts dd[data-fact=\"last error\"]")
        .await
        .is_none());
    // A job delayed by an hour reads as scheduled, not stuck. (A fresh
    // connection: a pooled one may have met serve's keep-alive timeout.)
    let r = reqwest::Client::new()
        .post(format!("{}/v1/jobs", serve.base))
        .bearer_auth(&token)
        .json(&json!({
            "id": "ui-later", "workflow": "completion", "webhook_url": env.consumer.url(),
            "delay_ms": 3_600_000,
            "input": { "model": "m", "messages": [{ "role": "user", "content": "later" }] },
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 201);
    browser.go(&format!("{}/#/jobs/ui-later", serve.base)).await;
    assert!(
        browser
            .wait_text("dd[data-fact=\"runs at\"]", |t| t.ends_with("(scheduled)"))
            .await,
        "a delayed job's page says it is scheduled"
    );

    // Bulk redrive of the dead jobs of one workflow, from the list.
    browser.go(&format!("{}/", serve.base)).await;
    browser.type_into("#workflow-filter", "completion").await;
    browser.click("a[data-state=\"dead\"]").await;
    assert!(
        browser
            .wait_text("tr[data-id=\"ui-dead-2\"] td[data-state]", |t| t == "dead")
            .await,
        "the dead filter lists ui-dead-2"
    );
    browser.type_into("#bulk-reason", "consumer back").await;
    browser.click("#redrive-dead").await;
    let acked = wait_until(Duration::from_secs(20), || async {
        env.store
            .jobs()
            .get("ui-dead-2")
            .await
            .ok()
            .flatten()
            .is_some_and(|j| j.state == onceflow_engine::JobState::Acked)
    })
    .await;
    assert!(acked, "the bulk redrive brought ui-dead-2 to acked");
    assert_eq!(env.consumer.processed_for("ui-dead-2"), 1, "one delivery");
    let job = env.store.jobs().get("ui-dead-2").await.unwrap().unwrap();
    assert!(
        job.history
            .iter()
            .any(|h| h.note.as_deref() == Some("redrive: consumer back")),
        "the reason is in its history: {:?}",
        job.history
    );
    browser.go(&format!("{}/", serve.base)).await;
    assert!(
        browser
            .wait_text("a[data-state=\"acked\"]", |t| t == "acked 3")
            .await
    );
    browser.screenshot(&shots.join("console.png")).await;
    browser.quit().await;
}

/// A tool call waiting for a person's approval shows on its job's page
/// with the tool and its arguments; the Approve button sends the approval,
/// and the tool runs once.
#[actix_rt::test]
async fn the_console_approves_a_waiting_tool_call_in_a_real_browser() {
    let env = TestEnv::new().await;
    let tools = onceflow_engine::testkit::FakeConsumer::start();
    crate::agent::script_tool_calls(&env, vec![("call_9", json!({ "refund": 9 }))]);
    let dir = tempfile::tempdir().unwrap();
    let serve = ServeProcess::start(
        &[
            ("DATABASE_URL", env.db_url.clone()),
            ("OPENAI_BASE_URL", env.provider.base_url()),
            ("ONCEFLOW_TOOL_POST_URL", tools.url()),
            ("ONCEFLOW_POLL_MS", "200".to_owned()),
        ],
        &dir.path().join("serve.log"),
    )
    .await;
    let token = env.store.tokens().create("console", true).await.unwrap();
    for id in ["ui-approve", "ui-reject"] {
        let r = client()
            .post(format!("{}/v1/jobs", serve.base))
            .bearer_auth(&token)
            .json(&json!({
                "id": id, "workflow": "agent", "webhook_url": env.consumer.url(),
                "input": { "model": "m", "messages": [{ "role": "user", "content": "refund 9" }],
                           "approval": ["http_post"] },
            }))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 201);
        let waiting = wait_until(Duration::from_secs(20), || async {
            env.store
                .jobs()
                .get(id)
                .await
                .ok()
                .flatten()
                .is_some_and(|j| j.waiting.is_some())
        })
        .await;
        assert!(waiting, "{id} waits for its approval");
    }

    let browser = Browser::start().await;
    browser.go(&format!("{}/", serve.base)).await;
    assert!(
        browser
            .wait_text("#login-title", |t| t == "API token")
            .await
    );
    browser.type_into("#token", &token).await;
    browser.click("#login-form button").await;

    // The list of jobs waiting for approval: each with its tool call and
    // the two buttons. Rejected from the list, the tool never runs.
    browser
        .go(&format!("{}/#/?state=approval", serve.base))
        .await;
    for id in ["ui-approve", "ui-reject"] {
        assert!(
            browser
                .wait_text(
                    &format!("tr[data-id=\"{id}\"] [data-fact=\"tool-call\"]"),
                    |t| t.starts_with("http_post") && t.contains("\"refund\":9")
                )
                .await,
            "{id} is listed with its tool call"
        );
    }
    browser
        .screenshot(&shots().join("console-approvals.png"))
        .await;
    let until = env
        .store
        .jobs()
        .get("ui-reject")
        .await
        .unwrap()
        .unwrap()
        .waiting
        .unwrap()["until"]
        .as_str()
        .unwrap()
        .to_owned();
    browser.click("tr[data-id=\"ui-reject\"] .row-reject").await;
    let rejected = wait_until(Duration::from_secs(20), || async {
        env.store
            .jobs()
            .get("ui-reject")
            .await
            .ok()
            .flatten()
            .is_some_and(|j| j.state == onceflow_engine::JobState::Acked)
    })
    .await;
    assert!(rejected, "the list's Reject button let the job go on");
    let job = env.store.jobs().get("ui-reject").await.unwrap().unwrap();
    assert_eq!(job.result.unwrap()["tool_calls"], 0);
    assert_eq!(job.signals.len(), 1, "{:?}", job.signals);
    assert_eq!(job.signals[0].payload, json!({ "approved": false }));
    let digits: String = until.chars().filter(char::is_ascii_digit).collect();
    assert_eq!(
        job.signals[0].id,
        format!("console-{digits}"),
        "the decision's id is its wait's"
    );
    assert_eq!(
        tools.requests_with_key("job:ui-reject:tool:0:0"),
        0,
        "a rejected tool call never runs"
    );
    // Only the approved one is left in the list.
    assert!(
        wait_until(Duration::from_secs(20), || async {
            browser.find("tr[data-id=\"ui-reject\"]").await.is_none()
        })
        .await,
        "the decided job left the list"
    );

    browser
        .go(&format!("{}/#/jobs/ui-approve", serve.base))
        .await;
    assert!(
        browser
            .wait_text("dd[data-fact=\"waiting\"]", |t| t
                .starts_with("waiting for approval approval:call_9"))
            .await,
        "the page says what the job waits for"
    );
    assert!(
        browser
            .wait_text("dd[data-fact=\"tool\"]", |t| t == "http_post")
            .await
    );
    // A waiting job reads as waiting, its wait's end as a timeout (not a
    // scheduled run), and the call waiting for approval is a tool call.
    assert!(
        browser
            .wait_text("dd[data-fact=\"state\"]", |t| t == "waiting for approval")
            .await,
        "the page says the job waits"
    );
    assert!(
        browser
            .find("dd[data-fact=\"times out at\"]")
            .await
            .is_some(),
        "the approval's timeout is labelled a timeout"
    );
    assert!(
        browser.find("dd[data-fact=\"runs at\"]").await.is_none(),
        "no scheduled run for a wait"
    );
    assert!(
        browser
            .wait_text(
                "#tool-calls tr[data-waiting=\"true\"] td[data-status=\"waiting\"]",
                |t| t == "waiting for approval"
            )
            .await,
        "the call waiting for approval is listed under Tool calls"
    );
    assert!(
        browser
            .wait_text("#children tr[data-empty=\"true\"] td", |t| t
                == "No child jobs.")
            .await,
        "an empty table says so"
    );
    assert!(
        browser
            .wait_text("dd[data-fact=\"arguments\"]", |t| t
                .contains("\"refund\":9"))
            .await
    );
    assert_eq!(
        tools.requests_with_key("job:ui-approve:tool:0:0"),
        0,
        "nothing ran yet"
    );
    browser
        .screenshot(&shots().join("console-approval.png"))
        .await;
    browser.type_into("#reason", "checked the order").await;
    browser.click("#approve").await;
    let acked = wait_until(Duration::from_secs(20), || async {
        env.store
            .jobs()
            .get("ui-approve")
            .await
            .ok()
            .flatten()
            .is_some_and(|j| j.state == onceflow_engine::JobState::Acked)
    })
    .await;
    assert!(acked, "the Approve button let the job finish");
    assert_eq!(
        tools.requests_with_key("job:ui-approve:tool:0:0"),
        1,
        "the tool ran once"
    );
    let job = env.store.jobs().get("ui-approve").await.unwrap().unwrap();
    assert_eq!(
        job.signals[0].payload,
        json!({ "approved": true, "note": "checked the order" })
    );
    browser.quit().await;
}

/// The schedules page lists a token's schedules with their next fire time
/// and links the newest job a schedule created.
#[actix_rt::test]
async fn the_console_lists_schedules_with_their_next_fire_time() {
    let env = TestEnv::new().await;
    let dir = tempfile::tempdir().unwrap();
    let serve = ServeProcess::start(
        &[
            ("DATABASE_URL", env.db_url.clone()),
            ("OPENAI_BASE_URL", env.provider.base_url()),
            ("ONCEFLOW_POLL_MS", "200".to_owned()),
            // A tenant's schedule every second (60 s at the least by default).
            ("ONCEFLOW_MIN_SCHEDULE_INTERVAL", "1s".to_owned()),
        ],
        &dir.path().join("serve.log"),
    )
    .await;
    let token = env.store.tokens().create("console", false).await.unwrap();
    let other = env.store.tokens().create("other", false).await.unwrap();
    for (id, cron, owner) in [
        ("every-second", "* * * * * *", &token),
        ("nightly", "0 2 * * *", &token),
        ("someone-elses", "0 3 * * *", &other),
    ] {
        let r = client()
            .post(format!("{}/v1/schedules", serve.base))
            .bearer_auth(owner)
            .json(&json!({
                "id": id, "cron": cron, "timezone": "Europe/Paris", "workflow": "completion",
                "webhook_url": env.consumer.url(),
                "input": { "model": "m", "messages": [{ "role": "user", "content": "tick" }] },
            }))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 201);
    }
    let browser = Browser::start().await;
    browser.go(&format!("{}/", serve.base)).await;
    assert!(
        browser
            .wait_text("#login-title", |t| t == "API token")
            .await
    );
    browser.type_into("#token", &token).await;
    browser.click("#login-form button").await;
    browser.click("#schedules-link").await;
    assert!(
        browser
            .wait_text("tr[data-id=\"nightly\"] td:nth-child(2)", |t| t
                == "0 2 * * *")
            .await,
        "the schedule is listed with its cron"
    );
    assert!(
        browser
            .wait_text("tr[data-id=\"nightly\"] td[data-fact=\"next-fire\"]", |t| {
                !t.is_empty() && t != "paused" && !t.contains("Invalid")
            })
            .await,
        "with its next fire time"
    );
    assert!(
        browser
            .wait_text("tr[data-id=\"every-second\"] td:last-child a", |t| t
                .starts_with("every-second:"))
            .await,
        "the newest job of a schedule that fired is linked"
    );
    assert!(
        browser
            .find("tr[data-id=\"someone-elses\"]")
            .await
            .is_none(),
        "another token's schedule is not listed"
    );
    browser
        .screenshot(&shots().join("console-schedules.png"))
        .await;
    browser.quit().await;
}

/// A parent's page lists its child jobs with their states, each linked; a
/// child's page links back to its parent.
#[actix_rt::test]
async fn the_console_links_a_parent_and_its_children() {
    let env = TestEnv::new().await;
    let token = env.store.tokens().create("console", true).await.unwrap();
    {
        // The jobs run on an engine that has the fan-out workflow; the
        // console's node only shows them.
        let engine = env.start(crate::children::registry(), env.config());
        env.submit_job(crate::children::parent(
            &env,
            "ui-parent",
            &["a", "b"],
            None,
        ))
        .await;
        env.wait_for(
            "ui-parent",
            onceflow_engine::JobState::Acked,
            Duration::from_secs(30),
        )
        .await;
        engine.shutdown();
    }
    let dir = tempfile::tempdir().unwrap();
    let serve = ServeProcess::start(
        &[("DATABASE_URL", env.db_url.clone())],
        &dir.path().join("serve.log"),
    )
    .await;
    let browser = Browser::start().await;
    browser.go(&format!("{}/", serve.base)).await;
    assert!(
        browser
            .wait_text("#login-title", |t| t == "API token")
            .await
    );
    browser.type_into("#token", &token).await;
    browser.click("#login-form button").await;
    browser
        .go(&format!("{}/#/jobs/ui-parent", serve.base))
        .await;
    assert!(
        browser
            .wait_text("#children tr:nth-child(2) a", |t| t == "ui-parent:child:c1")
            .await,
        "the parent lists its second child"
    );
    assert!(
        browser
            .wait_text("#children tr:nth-child(1) td[data-state]", |t| t == "acked")
            .await,
        "with its state"
    );
    browser.click("#children tr:nth-child(1) a").await;
    assert!(
        browser
            .wait_text("dd[data-fact=\"parent\"] a", |t| t == "ui-parent")
            .await,
        "the child links back to its parent"
    );
    browser.quit().await;
}

/// A streamed job's page shows its output as it is journaled: part of it
/// while the job still runs, then all of it, equal to the result.
#[actix_rt::test]
async fn the_console_shows_a_streamed_jobs_output_as_it_comes() {
    let env = TestEnv::new().await;
    // 12 chunks, 400 ms apart: about 5 s of streaming to watch.
    env.provider
        .set_stream_shape(12, Duration::from_millis(400));
    let dir = tempfile::tempdir().unwrap();
    let serve = ServeProcess::start(
        &[
            ("DATABASE_URL", env.db_url.clone()),
            ("OPENAI_BASE_URL", env.provider.base_url()),
            ("ONCEFLOW_POLL_MS", "200".to_owned()),
        ],
        &dir.path().join("serve.log"),
    )
    .await;
    let token = env.store.tokens().create("console", true).await.unwrap();
    let browser = Browser::start().await;
    browser.go(&format!("{}/", serve.base)).await;
    assert!(
        browser
            .wait_text("#login-title", |t| t == "API token")
            .await
    );
    browser.type_into("#token", &token).await;
    browser.click("#login-form button").await;
    let r = client()
        .post(format!("{}/v1/jobs", serve.base))
        .bearer_auth(&token)
        .json(&json!({
            "id": "ui-stream", "workflow": "completion", "webhook_url": env.consumer.url(),
            "input": { "model": "m", "stream": true,
                       "messages": [{ "role": "user", "content": "tell me" }] },
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 201);
    browser
        .go(&format!("{}/#/jobs/ui-stream", serve.base))
        .await;
    // Part of the answer, while the job is still running.
    assert!(
        browser
            .wait_text("#job-output", |t| t.starts_with("w1.0 "))
            .await,
        "the first chunks show"
    );
    let job = env.store.jobs().get("ui-stream").await.unwrap().unwrap();
    assert_eq!(
        job.state,
        onceflow_engine::JobState::Received,
        "shown while the job still runs"
    );
    assert!(job.result.is_none());
    browser
        .screenshot(&shots().join("console-streaming.png"))
        .await;
    let acked = wait_until(Duration::from_secs(30), || async {
        env.store
            .jobs()
            .get("ui-stream")
            .await
            .ok()
            .flatten()
            .is_some_and(|j| j.state == onceflow_engine::JobState::Acked)
    })
    .await;
    assert!(acked);
    let content = env
        .store
        .jobs()
        .get("ui-stream")
        .await
        .unwrap()
        .unwrap()
        .result
        .unwrap()["content"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        browser
            .wait_text("#job-output", |t| t.trim_end() == content.trim_end())
            .await,
        "the whole answer shows, once: {content:?}, shown {:?}",
        browser.text("#job-output").await
    );
    browser.quit().await;
}

/// A standard client, Chromium's own `EventSource`, with its automatic
/// reconnect: it follows a job to `acked`, the server ends the stream, the
/// client reconnects with the last id, gets `204` and stops for good. It
/// opened once, saw every event once, and is closed.
#[actix_rt::test]
async fn a_browsers_event_source_follows_a_job_and_stops_after_it_ends() {
    let env = TestEnv::new().await;
    env.provider.set_stream_shape(6, Duration::from_millis(100));
    let dir = tempfile::tempdir().unwrap();
    // No token: development mode on loopback (EventSource sends no headers).
    let serve = ServeProcess::start(
        &[
            ("DATABASE_URL", env.db_url.clone()),
            ("OPENAI_BASE_URL", env.provider.base_url()),
            ("ONCEFLOW_POLL_MS", "200".to_owned()),
        ],
        &dir.path().join("serve.log"),
    )
    .await;
    let r = client()
        .post(format!("{}/v1/jobs", serve.base))
        .json(&json!({
            "id": "es-1", "workflow": "completion", "webhook_url": env.consumer.url(),
            "input": { "model": "m", "stream": true,
                       "messages": [{ "role": "user", "content": "tell me" }] },
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 201);
    let browser = Browser::start().await;
    browser.go(&format!("{}/", serve.base)).await;
    browser
        .call(
            reqwest::Method::POST,
            "/timeouts",
            Some(json!({ "script": 40_000 })),
        )
        .await;
    // Follows the job until the EventSource closes itself (after the 204),
    // or 30 s pass.
    let script = r#"
        const done = arguments[arguments.length - 1];
        const seen = { opens: 0, ids: [], states: [], chunks: 0 };
        const source = new EventSource("/v1/jobs/es-1/events");
        source.onopen = () => { seen.opens += 1; };
        for (const kind of ["state", "chunk", "reset", "tool"]) {
            source.addEventListener(kind, (e) => {
                seen.ids.push(Number(e.lastEventId));
                if (kind === "state") seen.states.push(JSON.parse(e.data).text);
                if (kind === "chunk") seen.chunks += 1;
            });
        }
        const started = Date.now();
        const check = setInterval(() => {
            if (source.readyState === EventSource.CLOSED || Date.now() - started > 30000) {
                clearInterval(check);
                seen.closed = source.readyState === EventSource.CLOSED;
                source.close();
                // The answers its connections got (Resource Timing).
                seen.statuses = performance.getEntriesByType("resource")
                    .filter((e) => e.name.endsWith("/v1/jobs/es-1/events"))
                    .map((e) => e.responseStatus);
                done(seen);
            }
        }, 100);
    "#;
    let answer = browser
        .call(
            reqwest::Method::POST,
            "/execute/async",
            Some(json!({ "script": script, "args": [] })),
        )
        .await;
    let seen = &answer["value"];
    assert_eq!(
        seen["closed"], true,
        "the EventSource stopped by itself: {seen}"
    );
    assert_eq!(
        seen["opens"], 1,
        "it did not come back after the 204: {seen}"
    );
    // It connected twice (Resource Timing): the stream, then one reconnect
    // that opened nothing. What the server answers that reconnect, the
    // last id, is a 204 (an EventSource gets no status to show).
    let statuses = seen["statuses"].as_array().unwrap();
    assert_eq!(statuses.len(), 2, "one reconnect: {seen}");
    assert_eq!(statuses[0], 200, "{seen}");
    let ids: Vec<i64> = seen["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_i64().unwrap())
        .collect();
    assert!(
        ids.windows(2).all(|w| w[0] < w[1]),
        "each event once: {ids:?}"
    );
    // A fresh connection: the shared client's pooled one may be closed
    // by the server's keep-alive timeout just as it is reused.
    let again = reqwest::Client::new()
        .get(format!("{}/v1/jobs/es-1/events", serve.base))
        .header("last-event-id", ids.last().unwrap().to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(again.status().as_u16(), 204);
    assert_eq!(seen["chunks"], 6, "{seen}");
    assert_eq!(
        seen["states"],
        json!([
            "received",
            "generated",
            "persisted",
            "claimed",
            "delivered",
            "acked"
        ]),
        "{seen}"
    );
    browser.quit().await;
}
