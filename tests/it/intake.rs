//! Intake through the real HTTP API: idempotent on the job id, decided by the
//! database, and no bad request changes stored state.

use futures_util::future::join_all;
use onceflow_engine::testkit::TestEnv;
use serde_json::{json, Value};

use crate::support::{get, post_job, post_raw, serve_api};

fn job(id: &str, model: &str, webhook: &str) -> Value {
    json!({
        "id": id,
        "workflow": "completion",
        "input": { "model": model, "messages": [{ "role": "user", "content": "hello" }] },
        "webhook_url": webhook,
    })
}

async fn counts(env: &TestEnv) -> (i64, i64) {
    let rows = env
        .sql("SELECT (SELECT count(*) FROM jobs) AS jobs, (SELECT count(*) FROM job_history) AS history")
        .await;
    (
        rows[0]["jobs"].as_i64().unwrap(),
        rows[0]["history"].as_i64().unwrap(),
    )
}

#[actix_rt::test]
async fn identical_resubmission_is_200_and_a_different_body_is_409() {
    let env = TestEnv::new().await;
    let base = serve_api(&env, onceflow_workflows::registry(), None);
    let hook = env.consumer.url();

    let (status, created) = post_job(&base, &job("order-1", "m1", &hook)).await;
    assert_eq!(status, 201, "{created}");
    assert_eq!(created["state"], "received");
    assert_eq!(created["history"].as_array().unwrap().len(), 1);
    assert_eq!(created["history"][0]["state"], "received");

    // Same request, other key order and whitespace: the stored job, 200.
    let reordered = format!(
        r#"{{ "webhook_url": "{hook}", "input": {{"messages": [{{"content": "hello", "role": "user"}}], "model": "m1"}},
            "workflow": "completion", "id": "order-1" }}"#
    );
    let (status, again) = post_raw(&base, reordered).await;
    assert_eq!(status, 200, "{again}");
    assert_eq!(again["created_at"], created["created_at"]);

    // Same id, different request: 409, and the stored job is untouched.
    let (status, conflict) = post_job(&base, &job("order-1", "m2", &hook)).await;
    assert_eq!(status, 409, "{conflict}");
    assert_eq!(conflict["error"]["code"], "conflict");
    let (status, stored) = get(&format!("{base}/v1/jobs/order-1")).await;
    assert_eq!(status, 200);
    assert_eq!(stored["input"]["model"], "m1");
    assert_eq!(stored["updated_at"], created["updated_at"]);
    assert_eq!(counts(&env).await, (1, 1));
}

#[actix_rt::test]
async fn concurrent_identical_submissions_create_one_job() {
    let env = TestEnv::new().await;
    let base = serve_api(&env, onceflow_workflows::registry(), None);
    let body = job("race-1", "m", &env.consumer.url());
    let statuses: Vec<u16> = join_all((0..12).map(|_| post_job(&base, &body)))
        .await
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    assert_eq!(
        statuses.iter().filter(|s| **s == 201).count(),
        1,
        "{statuses:?}"
    );
    assert_eq!(
        statuses.iter().filter(|s| **s == 200).count(),
        11,
        "{statuses:?}"
    );
    assert_eq!(counts(&env).await, (1, 1));
}

#[actix_rt::test]
async fn concurrent_different_submissions_leave_one_job_and_conflicts() {
    let env = TestEnv::new().await;
    let base = serve_api(&env, onceflow_workflows::registry(), None);
    let hook = env.consumer.url();
    let results = join_all((0..12).map(|i| {
        let body = job("race-2", &format!("model-{i}"), &hook);
        let base = base.clone();
        async move { post_job(&base, &body).await }
    }))
    .await;
    let winners: Vec<&Value> = results
        .iter()
        .filter(|(s, _)| *s == 201)
        .map(|(_, v)| v)
        .collect();
    assert_eq!(winners.len(), 1, "{results:?}");
    assert_eq!(
        results.iter().filter(|(s, _)| *s == 409).count(),
        11,
        "{results:?}"
    );
    let (_, stored) = get(&format!("{base}/v1/jobs/race-2")).await;
    assert_eq!(stored["input"]["model"], winners[0]["input"]["model"]);
    assert_eq!(counts(&env).await, (1, 1));
}

#[actix_rt::test]
async fn every_bad_input_is_refused_and_changes_nothing() {
    let env = TestEnv::new().await;
    let base = serve_api(&env, onceflow_workflows::registry(), None);
    let hook = env.consumer.url();
    let good = job("ok-1", "m", &hook);
    let with = |path: &[&str], value: Value| {
        let mut body = good.clone();
        let mut target = &mut body;
        for p in &path[..path.len() - 1] {
            target = &mut target[*p];
        }
        target[path[path.len() - 1]] = value;
        body
    };
    let without = |field: &str| {
        let mut body = good.clone();
        body.as_object_mut().unwrap().remove(field);
        body
    };
    let cases: Vec<(&str, Vec<u8>, u16, Option<&str>)> = vec![
        ("malformed JSON", b"{\"id\": ".to_vec(), 400, None),
        ("not JSON at all", b"hello".to_vec(), 400, None),
        ("an array", b"[1,2]".to_vec(), 422, Some("body")),
        (
            "missing id",
            serde_json::to_vec(&without("id")).unwrap(),
            422,
            Some("id"),
        ),
        (
            "numeric id",
            serde_json::to_vec(&with(&["id"], json!(42))).unwrap(),
            422,
            Some("id"),
        ),
        (
            "empty id",
            serde_json::to_vec(&with(&["id"], json!(""))).unwrap(),
            422,
            Some("id"),
        ),
        (
            "201-character id",
            serde_json::to_vec(&with(&["id"], json!("a".repeat(201)))).unwrap(),
            422,
            Some("id"),
        ),
        (
            "id with a space",
            serde_json::to_vec(&with(&["id"], json!("a b"))).unwrap(),
            422,
            Some("id"),
        ),
        (
            "id with a slash",
            serde_json::to_vec(&with(&["id"], json!("a/b"))).unwrap(),
            422,
            Some("id"),
        ),
        (
            "unknown workflow",
            serde_json::to_vec(&with(&["workflow"], json!("nope"))).unwrap(),
            422,
            Some("workflow"),
        ),
        (
            // (A missing webhook is a job without one: see
            // `a_job_without_a_webhook_is_acked_with_its_result_and_posts_nothing`.)
            "a webhook that is not a string",
            serde_json::to_vec(&with(&["webhook_url"], json!(7))).unwrap(),
            422,
            Some("webhook_url"),
        ),
        (
            "relative webhook",
            serde_json::to_vec(&with(&["webhook_url"], json!("/hook"))).unwrap(),
            422,
            Some("webhook_url"),
        ),
        (
            "ftp webhook",
            serde_json::to_vec(&with(&["webhook_url"], json!("ftp://example.com/x"))).unwrap(),
            422,
            Some("webhook_url"),
        ),
        (
            "missing input",
            serde_json::to_vec(&without("input")).unwrap(),
            422,
            Some("input"),
        ),
        (
            "input not an object",
            serde_json::to_vec(&with(&["input"], json!("hi"))).unwrap(),
            422,
            Some("input"),
        ),
        (
            "missing model",
            serde_json::to_vec(&with(
                &["input"],
                json!({"messages": [{"role": "user", "content": "x"}]}),
            ))
            .unwrap(),
            422,
            Some("input"),
        ),
        (
            "empty model",
            serde_json::to_vec(&with(&["input", "model"], json!(" "))).unwrap(),
            422,
            Some("input.model"),
        ),
        (
            "no messages",
            serde_json::to_vec(&with(&["input", "messages"], json!([]))).unwrap(),
            422,
            Some("input.messages"),
        ),
        (
            "bad role",
            serde_json::to_vec(&with(
                &["input", "messages"],
                json!([{"role": "bot", "content": "x"}]),
            ))
            .unwrap(),
            422,
            Some("input.messages[0].role"),
        ),
        (
            "unknown input field",
            serde_json::to_vec(&with(&["input", "colour"], json!("red"))).unwrap(),
            422,
            Some("input"),
        ),
        (
            "unknown top-level field",
            serde_json::to_vec(&with(&["colour"], json!(1))).unwrap(),
            422,
            Some("colour"),
        ),
        (
            "over the size limit",
            {
                let mut big = good.clone();
                big["input"]["messages"][0]["content"] = json!("x".repeat(1 << 20));
                serde_json::to_vec(&big).unwrap()
            },
            413,
            None,
        ),
    ];
    for (name, body, status, field) in cases {
        let (got, answer) = post_raw(&base, body).await;
        assert_eq!(got, status, "{name}: {answer}");
        let code = answer["error"]["code"].as_str();
        assert!(
            code.is_some_and(|c| !c.is_empty()),
            "{name}: no error code in {answer}"
        );
        assert!(
            answer["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{name}: {answer}"
        );
        if let Some(field) = field {
            let got_field = answer["error"]["field"].as_str().unwrap_or_default();
            assert!(
                got_field.starts_with(field),
                "{name}: field {got_field:?}, wanted {field:?}"
            );
        }
        assert_eq!(counts(&env).await, (0, 0), "{name} changed the database");
    }
    // The server is still up and accepts a good request.
    let (status, _) = post_job(&base, &good).await;
    assert_eq!(status, 201);
    assert_eq!(counts(&env).await, (1, 1));
}

#[actix_rt::test]
async fn the_body_limit_is_configurable() {
    let env = TestEnv::new().await;
    let base = serve_api(&env, onceflow_workflows::registry(), Some(400));
    let mut body = job("small-1", "m", &env.consumer.url());
    let (status, _) = post_job(&base, &body).await;
    assert_eq!(status, 201);
    body["id"] = json!("small-2");
    body["input"]["messages"][0]["content"] = json!("x".repeat(500));
    let (status, answer) = post_job(&base, &body).await;
    assert_eq!(status, 413, "{answer}");
    assert_eq!(counts(&env).await, (1, 1));
}

#[actix_rt::test]
async fn unknown_jobs_and_routes_are_404_and_healthz_is_200() {
    let env = TestEnv::new().await;
    let base = serve_api(&env, onceflow_workflows::registry(), None);
    let (status, answer) = get(&format!("{base}/v1/jobs/nope")).await;
    assert_eq!(status, 404);
    assert_eq!(answer["error"]["code"], "not_found");
    let (status, answer) = get(&format!("{base}/v2/whatever")).await;
    assert_eq!(status, 404, "{answer}");
    // A path the API serves, with a method it does not: 405 and Allow.
    let r = crate::support::client()
        .delete(format!("{base}/v1/jobs/nope"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 405);
    assert_eq!(r.headers()["allow"], "GET");
    let r = crate::support::client()
        .put(format!("{base}/v1/jobs"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 405);
    assert_eq!(r.headers()["allow"], "GET, POST");
    let (status, answer) = get(&format!("{base}/healthz")).await;
    assert_eq!(status, 200, "{answer}");
}

/// The database holds the shapes of ids and hashes on its own (domains
/// `job_id` and `sha256_hex`), whatever the API lets through: exactly the
/// values `^[A-Za-z0-9_.:-]{1,200}$` and `^[0-9a-f]{64}$` accept, no more
/// and no fewer (migration 000018 writes them without the costly bounded
/// repetition; these are its edges).
#[actix_rt::test]
async fn the_database_accepts_exactly_the_documented_id_and_hash_shapes() {
    use diesel_async::RunQueryDsl;
    let env = TestEnv::new().await;
    let mut conn = env.store.db().conn().await.expect("conn");
    let cases: &[(&str, &str, bool)] = &[
        ("job_id", "'a'", true),
        ("job_id", "'Az09_.:-'", true),
        ("job_id", "repeat('x', 200)", true),
        ("job_id", "''", false),
        ("job_id", "repeat('x', 201)", false),
        ("job_id", "'a b'", false),
        ("job_id", "'a/b'", false),
        ("job_id", "E'a\\n'", false),
        ("job_id", "E'\\na'", false),
        ("job_id", "'é'", false),
        // The neighbours of each range in the class, at the start, in the
        // middle and at the end.
        ("job_id", "'@a'", false),
        ("job_id", "'a[a'", false),
        ("job_id", "'a`'", false),
        ("job_id", "'{'", false),
        ("job_id", "'a;a'", false),
        ("sha256_hex", "repeat('0a', 32)", true),
        ("sha256_hex", "repeat('9', 64)", true),
        ("sha256_hex", "repeat('f', 64)", true),
        ("sha256_hex", "repeat('a', 63)", false),
        ("sha256_hex", "repeat('a', 65)", false),
        ("sha256_hex", "repeat('A', 64)", false),
        ("sha256_hex", "repeat('g', 64)", false),
        ("sha256_hex", "'g' || repeat('a', 63)", false),
        (
            "sha256_hex",
            "repeat('a', 31) || '/' || repeat('a', 32)",
            false,
        ),
        ("sha256_hex", "repeat('a', 63) || ':'", false),
        ("sha256_hex", "repeat('a', 63) || E'\\n'", false),
    ];
    for &(domain, value, valid) in cases {
        let cast = format!("SELECT ({value})::{domain}");
        match diesel::sql_query(&cast).execute(&mut conn).await {
            Ok(_) => assert!(valid, "{cast} was accepted"),
            Err(e) => {
                assert!(!valid, "{cast} was refused: {e}");
                assert!(
                    e.to_string().contains(&format!("domain {domain} violates")),
                    "{cast}: {e}"
                );
            }
        }
    }
    // Only the checks without a bounded repetition remain (they are what
    // keeps the regular-expression engine cheap).
    let constraints = env
        .sql(
            "SELECT t.typname::text AS domain, c.conname::text AS name FROM pg_constraint c \
             JOIN pg_type t ON t.oid = c.contypid \
             WHERE t.typname IN ('job_id', 'sha256_hex') ORDER BY 1, 2",
        )
        .await;
    assert_eq!(
        constraints,
        serde_json::json!([
            {"domain": "job_id", "name": "job_id_shape"},
            {"domain": "sha256_hex", "name": "sha256_hex_shape"}
        ])
    );
}

/// The served OpenAPI document shows, per registered workflow, its name
/// and its input's schema, and the schema says what intake accepts: an
/// input with every property the schema names is taken (201), every field
/// of the input types is in the schema (so a new field cannot be left out
/// of the document), and a property the schema does not name is refused
/// (422), as `additionalProperties: false` says.
#[actix_rt::test]
async fn the_document_shows_each_workflows_input_as_intake_takes_it() {
    use onceflow_workflows::agent::{AgentInput, Approval};
    use onceflow_workflows::completion::{CompletionInput, Message, ModelProvider, Role};
    let env = TestEnv::new().await;
    // The agent has `http_post`, which the approval list below names, and
    // an MCP server `shop` (no engine runs here: it is never reached).
    let shop = onceflow_workflows::mcp::McpServers::from_setting(
        r#"{"shop": {"url": "http://127.0.0.1:9/mcp"}}"#,
    )
    .unwrap();
    let registry =
        onceflow_workflows::registry_with_mcp(Some("http://127.0.0.1:9/tool"), &[], shop);
    let base = serve_api(&env, registry, None);
    let hook = env.consumer.url();
    let (status, doc) = get(&format!("{base}/v1/openapi.json")).await;
    assert_eq!(status, 200);
    // Each variant is a component of its own, chosen by `workflow`.
    let resolve = |v: &Value| -> Value {
        let name = v["$ref"]
            .as_str()
            .and_then(|r| r.strip_prefix("#/components/schemas/"))
            .unwrap_or_else(|| panic!("a variant is a named component: {v}"));
        doc["components"]["schemas"][name].clone()
    };
    assert_eq!(
        doc["components"]["schemas"]["SubmitJob"]["discriminator"]["propertyName"],
        "workflow"
    );
    let variants: Vec<Value> = doc["components"]["schemas"]["SubmitJob"]["oneOf"]
        .as_array()
        .expect("SubmitJob is one variant per workflow")
        .iter()
        .map(resolve)
        .collect();
    let input_of = |name: &str| {
        variants
            .iter()
            .find(|v| v["properties"]["workflow"]["const"] == name)
            .unwrap_or_else(|| panic!("no variant for {name}: {variants:?}"))["properties"]["input"]
            .clone()
    };
    let mut names: Vec<&str> = variants
        .iter()
        .map(|v| v["properties"]["workflow"]["const"].as_str().unwrap())
        .collect();
    names.sort();
    let mut registered: Vec<&str> = onceflow_workflows::registry().names().collect();
    registered.sort();
    assert_eq!(names, registered, "one variant per registered workflow");
    let schedules = doc["components"]["schemas"]["CreateSchedule"]["oneOf"]
        .as_array()
        .expect("CreateSchedule too");
    assert_eq!(schedules.len(), registered.len());

    let completion = CompletionInput {
        model: "m".into(),
        messages: vec![Message {
            role: Role::User,
            content: "hi".into(),
        }],
        temperature: Some(0.5),
        max_tokens: Some(10),
        provider: ModelProvider::Anthropic,
        stream: true,
    };
    let agent = AgentInput {
        model: "m".into(),
        messages: vec![json!({ "role": "user", "content": "hi" })],
        max_turns: Some(2),
        provider: ModelProvider::Anthropic,
        stream: true,
        approval: Some(Approval::Tools(vec!["http_post".into()])),
        approval_timeout_s: Some(60),
        mcp: vec!["shop".into()],
    };
    for (workflow, input) in [
        ("completion", serde_json::to_value(&completion).unwrap()),
        ("agent", serde_json::to_value(&agent).unwrap()),
    ] {
        let schema = input_of(workflow);
        assert_eq!(schema["additionalProperties"], false, "{workflow}");
        let mut documented: Vec<&String> =
            schema["properties"].as_object().unwrap().keys().collect();
        let mut fields: Vec<&String> = input.as_object().unwrap().keys().collect();
        documented.sort();
        fields.sort();
        assert_eq!(
            documented, fields,
            "{workflow}: the schema names every field"
        );
        let required: Vec<&str> = schema["required"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r.as_str().unwrap())
            .collect();
        assert_eq!(required, ["model", "messages"], "{workflow}");
        let id = format!("doc-{workflow}");
        let job = json!({ "id": id, "workflow": workflow, "input": input, "webhook_url": hook });
        let (status, body) = post_job(&base, &job).await;
        assert_eq!(status, 201, "{workflow}: {body}");
        let mut extra = input.clone();
        extra["colour"] = json!("blue");
        let job = json!({ "id": format!("{id}-x"), "workflow": workflow, "input": extra, "webhook_url": hook });
        let (status, body) = post_job(&base, &job).await;
        assert_eq!(status, 422, "{workflow}: {body}");
        assert_eq!(body["error"]["field"], "input.colour", "{workflow}: {body}");
    }
}

/// The document (with a token) types what each workflow's jobs return:
/// `Result_completion` and `Result_agent` name exactly the fields a
/// finished job's `result` has, their required ones among them, and
/// `JobView.result` points at them.
#[actix_rt::test]
async fn the_document_types_each_workflows_result_as_jobs_return_it() {
    use onceflow_engine::JobState;
    let env = TestEnv::new().await;
    let registry = || onceflow_workflows::registry_with(Some("http://127.0.0.1:9/tool"));
    let _engine = env.start(registry(), env.config());
    let base = serve_api(&env, registry(), None);
    let (status, doc) = get(&format!("{base}/v1/openapi.json")).await;
    assert_eq!(status, 200);
    let schemas = &doc["components"]["schemas"];
    let described = schemas["JobView"]["properties"]["result"]["description"]
        .as_str()
        .unwrap_or_default();
    for (workflow, input) in [
        (
            "completion",
            json!({ "model": "m", "messages": [{ "role": "user", "content": "hi" }] }),
        ),
        (
            "agent",
            json!({ "model": "m", "messages": [{ "role": "user", "content": "hi" }] }),
        ),
    ] {
        let component = format!("Result_{workflow}");
        assert!(described.contains(&component), "{described}");
        let id = format!("typed-{workflow}");
        let body = json!({ "id": id, "workflow": workflow, "input": input, "webhook_url": env.consumer.url() });
        let (status, created) = post_job(&base, &body).await;
        assert_eq!(status, 201, "{created}");
        let result = env
            .wait_for(&id, JobState::Acked, std::time::Duration::from_secs(20))
            .await
            .result
            .expect("a result");
        let schema = &schemas[&component];
        let mut documented: Vec<&String> =
            schema["properties"].as_object().unwrap().keys().collect();
        let mut returned: Vec<&String> = result.as_object().unwrap().keys().collect();
        documented.sort();
        returned.sort();
        assert_eq!(documented, returned, "{workflow}: {result}");
        for required in schema["required"].as_array().unwrap() {
            let field = required.as_str().unwrap();
            assert!(
                result.get(field).is_some(),
                "{workflow}.{field} in {result}"
            );
        }
        // Each value is of a type its field allows.
        for (field, value) in result.as_object().unwrap() {
            let allowed: Vec<&str> = match &schema["properties"][field]["type"] {
                Value::String(t) => vec![t.as_str()],
                Value::Array(ts) => ts.iter().filter_map(Value::as_str).collect(),
                other => panic!("{workflow}.{field}: no type in {other}"),
            };
            let kind = match value {
                Value::Null => "null",
                Value::Bool(_) => "boolean",
                Value::Number(n) if n.is_i64() || n.is_u64() => "integer",
                Value::Number(_) => "number",
                Value::String(_) => "string",
                Value::Array(_) => "array",
                Value::Object(_) => "object",
            };
            assert!(
                allowed.contains(&kind) || (kind == "integer" && allowed.contains(&"number")),
                "{workflow}.{field} is {kind}, the document allows {allowed:?}"
            );
        }
    }
}

/// A job needs no webhook: submitted without `webhook_url` it runs to
/// `acked` with its result stored, its model call paid once, and nothing
/// is POSTed anywhere (the consumer, never named, counts no request; no
/// outbox row has a URL). Its failure events have nowhere to go either:
/// none is queued.
#[actix_rt::test]
async fn a_job_without_a_webhook_is_acked_with_its_result_and_posts_nothing() {
    use onceflow_engine::{JobState, Registry};
    let env = TestEnv::new().await;
    let registry = || {
        let mut r = Registry::new();
        r.register(onceflow_workflows::Completion::default());
        r.with_failure_events(true);
        r
    };
    let _engine = env.start(registry(), env.config());
    let base = serve_api(&env, registry(), None);
    let mut body = job("quiet-1", "m", "unused");
    body.as_object_mut().unwrap().remove("webhook_url");
    let (status, created) = post_job(&base, &body).await;
    assert_eq!(status, 201, "{created}");
    let mut null = job("quiet-2", "m", "unused");
    null["webhook_url"] = Value::Null;
    let (status, created) = post_job(&base, &null).await;
    assert_eq!(status, 201, "null is no webhook: {created}");
    let mut empty = job("quiet-3", "m", "unused");
    empty["webhook_url"] = json!("");
    let (status, refused) = post_job(&base, &empty).await;
    assert_eq!(
        (status, refused["error"]["field"].as_str()),
        (422, Some("webhook_url"))
    );
    for id in ["quiet-1", "quiet-2"] {
        let view = env
            .wait_for(id, JobState::Acked, std::time::Duration::from_secs(20))
            .await;
        assert!(view.result.is_some(), "{id}: its result is stored");
        // Recorded delivered, with no answer from anyone: status 0.
        let delivery = view.delivery.expect("the completion's row");
        assert_eq!(
            (delivery.status.as_str(), delivery.last_status),
            ("delivered", Some(0))
        );
        assert_eq!(env.provider.requests_for(&format!("job:{id}:generate")), 1);
    }
    // A job that dies without a webhook queues no failure event.
    env.provider
        .push(onceflow_engine::testkit::Behaviour::Status(400, None));
    let mut dies = job("quiet-dead", "m", "unused");
    dies.as_object_mut().unwrap().remove("webhook_url");
    assert_eq!(post_job(&base, &dies).await.0, 201);
    env.wait_for(
        "quiet-dead",
        JobState::Dead,
        std::time::Duration::from_secs(20),
    )
    .await;
    assert_eq!(env.consumer.delivery_count(), 0, "nothing was POSTed");
    let sent = env
        .sql("SELECT count(*) AS n FROM outbox WHERE url <> '' OR event <> 'job.completed'")
        .await;
    assert_eq!(sent[0]["n"], 0, "no event has anywhere to go");
}

/// Batch submit: each job of `POST /v1/jobs/batch` is answered, in order,
/// as a single submit would be (201, 200 for the same job again, 409 for
/// its id with another request, 422 naming the field), one refusal never
/// fails the others, and each created job runs once.
#[actix_rt::test]
async fn a_batch_answers_each_job_as_a_single_submit_would() {
    use onceflow_engine::{JobState, Registry};
    let env = TestEnv::new().await;
    let registry = || {
        let mut r = Registry::new();
        r.register(onceflow_workflows::Completion::default());
        r
    };
    let _engine = env.start(registry(), env.config());
    let base = serve_api(&env, registry(), None);
    let url = format!("{base}/v1/jobs/batch");
    let hook = env.consumer.url();
    let mut no_workflow = job("b-2", "m", &hook);
    no_workflow.as_object_mut().unwrap().remove("workflow");
    let (status, answer) = post_raw_to(
        &url,
        json!({ "jobs": [job("b-1", "m", &hook), no_workflow, job("b-3", "m", &hook)] }),
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    let statuses: Vec<u64> = answer["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["status"].as_u64().unwrap())
        .collect();
    assert_eq!(statuses, [201, 422, 201], "{answer}");
    assert_eq!(answer["jobs"][1]["error"]["field"], "workflow");
    assert_eq!(answer["jobs"][0]["job"]["id"], "b-1");
    let (_, again) = post_raw_to(
        &url,
        json!({ "jobs": [job("b-1", "m", &hook), job("b-1", "other-model", &hook), job("b-4", "m", &hook)] }),
    )
    .await;
    let statuses: Vec<u64> = again["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["status"].as_u64().unwrap())
        .collect();
    assert_eq!(statuses, [200, 409, 201], "{again}");
    for id in ["b-1", "b-3", "b-4"] {
        env.wait_for(id, JobState::Acked, std::time::Duration::from_secs(20))
            .await;
        assert_eq!(
            env.provider.requests_for(&format!("job:{id}:generate")),
            1,
            "{id}"
        );
    }
    let too_many: Vec<Value> = (0..1001)
        .map(|i| job(&format!("x-{i}"), "m", &hook))
        .collect();
    for (bad, field) in [
        (json!({ "jobs": [] }), "jobs"),
        (json!({ "jobs": too_many }), "jobs"),
        (json!({ "jobs": {} }), "jobs"),
        (
            json!({ "jobs": [job("b-8", "m", &hook), [null]] }),
            "jobs[1]",
        ),
        (
            json!({ "jobs": [job("b-9", "m", &hook)], "more": 1 }),
            "more",
        ),
    ] {
        let (status, body) = post_raw_to(&url, bad).await;
        assert_eq!(
            (status, body["error"]["field"].as_str()),
            (422, Some(field)),
            "{body}"
        );
    }
    assert_eq!(counts(&env).await.0, 3, "b-1, b-3 and b-4 alone");
}

/// A NUL character in one job of a batch is that job's `422`, naming
/// where; the other jobs of the batch are taken.
#[actix_rt::test]
async fn a_nul_in_one_job_of_a_batch_refuses_that_job_alone() {
    use onceflow_engine::Registry;
    let env = TestEnv::new().await;
    let registry = || {
        let mut r = Registry::new();
        r.register(onceflow_workflows::Completion::default());
        r
    };
    let base = serve_api(&env, registry(), None);
    let hook = env.consumer.url();
    let mut bad = job("nul-1", "m", &hook);
    bad["input"]["messages"][0]["content"] = json!("a\u{0}b");
    let (status, answer) = post_raw_to(
        &format!("{base}/v1/jobs/batch"),
        json!({ "jobs": [bad, job("nul-2", "m", &hook)] }),
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["jobs"][0]["status"], 422, "{answer}");
    assert_eq!(
        answer["jobs"][0]["error"]["field"],
        "input.messages[0].content"
    );
    assert_eq!(answer["jobs"][1]["status"], 201, "{answer}");
    assert_eq!(counts(&env).await.0, 1, "nul-2 alone");
}

async fn post_raw_to(url: &str, body: Value) -> (u16, Value) {
    let r = crate::support::client()
        .post(url)
        .header("content-type", "application/json")
        .body(serde_json::to_vec(&body).unwrap())
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// Tags: a job carries `"tags": {"label": "value"}` (bounded, part of the
/// request), shown in its view and its list row; `?tag=label:value` lists
/// the jobs that have it; a bulk cancel takes the same filter.
#[actix_rt::test]
async fn jobs_carry_tags_and_are_listed_and_cancelled_by_them() {
    let env = TestEnv::new().await;
    let base = serve_api(&env, onceflow_workflows::registry(), None);
    let hook = env.consumer.url();
    for (id, team) in [("t-1", "a"), ("t-2", "b"), ("t-3", "a")] {
        let mut body = job(id, "m", &hook);
        body["tags"] = json!({ "team": team, "env": "prod" });
        body["delay_ms"] = json!(3_600_000);
        let (status, created) = post_job(&base, &body).await;
        assert_eq!(status, 201, "{created}");
        assert_eq!(created["tags"], json!({ "team": team, "env": "prod" }));
    }
    let mut other = job("t-1", "m", &hook);
    other["tags"] = json!({ "team": "c", "env": "prod" });
    other["delay_ms"] = json!(3_600_000);
    assert_eq!(
        post_job(&base, &other).await.0,
        409,
        "tags are part of the request"
    );
    let many: serde_json::Map<String, Value> =
        (0..21).map(|i| (format!("k{i}"), json!("v"))).collect();
    for (tags, field) in [
        (json!({ "a:b": "v" }), "tags"),
        (json!({ "k": 7 }), "tags.k"),
        (json!({ "k": "v".repeat(257) }), "tags.k"),
        (Value::Object(many), "tags"),
        (json!(["team"]), "tags"),
    ] {
        let mut bad = job("t-bad", "m", &hook);
        bad["tags"] = tags;
        let (status, body) = post_job(&base, &bad).await;
        assert_eq!(
            (status, body["error"]["field"].as_str()),
            (422, Some(field)),
            "{body}"
        );
    }
    let (status, page) = get(&format!("{base}/v1/jobs?tag=team:a")).await;
    assert_eq!(status, 200, "{page}");
    let ids: Vec<&str> = page["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["t-3", "t-1"], "newest first, team a only");
    assert_eq!(page["jobs"][0]["tags"]["team"], "a");
    let (status, _) = get(&format!("{base}/v1/jobs?tag=nocolon")).await;
    assert_eq!(status, 422);
    let (status, answer) = post_raw_to(
        &format!("{base}/v1/jobs/cancel"),
        json!({ "tag": "team:b" }),
    )
    .await;
    assert_eq!((status, &answer), (202, &json!({ "cancelled": 1 })));
    assert_eq!(
        env.job("t-2").await.state,
        onceflow_engine::JobState::Cancelled
    );
    assert_eq!(
        env.job("t-1").await.state,
        onceflow_engine::JobState::Received
    );
}

/// A concurrency key: 1–200 characters, part of the request (another key
/// is `409`), shown in the view; anything else is `422` naming the field.
#[actix_rt::test]
async fn a_concurrency_key_is_checked_and_part_of_the_request() {
    let env = TestEnv::new().await;
    let base = serve_api(&env, onceflow_workflows::registry(), None);
    let hook = env.consumer.url();
    let mut body = job("ck-1", "m", &hook);
    body["concurrency_key"] = json!("customer-7");
    body["delay_ms"] = json!(3_600_000);
    let (status, created) = post_job(&base, &body).await;
    assert_eq!(status, 201, "{created}");
    assert_eq!(created["concurrency_key"], "customer-7");
    assert_eq!(
        post_job(&base, &body).await.0,
        200,
        "the same request again"
    );
    body["concurrency_key"] = json!("customer-8");
    assert_eq!(
        post_job(&base, &body).await.0,
        409,
        "the key is part of the request"
    );
    for bad_key in [json!(""), json!("k".repeat(201)), json!(7), json!({})] {
        let mut bad = job("ck-bad", "m", &hook);
        bad["concurrency_key"] = bad_key;
        let (status, answer) = post_job(&base, &bad).await;
        assert_eq!(
            (status, answer["error"]["field"].as_str()),
            (422, Some("concurrency_key")),
            "{answer}"
        );
    }
    let stored = env
        .sql("SELECT concurrency_key, concurrency_limit, tenant FROM jobs WHERE id = 'ck-1'")
        .await;
    assert_eq!(
        stored[0],
        json!({ "concurrency_key": "customer-7", "concurrency_limit": 1, "tenant": 0 }),
        "no token or workflow limit: 1; development mode is tenant 0"
    );
}
