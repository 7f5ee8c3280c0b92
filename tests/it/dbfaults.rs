//! The guarantee under database faults: errors PostgreSQL itself raises (from
//! triggers, by SQLSTATE), a heartbeat that fails past the lease, one row
//! PostgreSQL refuses inside a group commit, zombies writing with a stale
//! epoch, and the at-most-once policy when its last write fails. Every test
//! counts the requests the fake provider and consumer received and checks
//! that the injected fault actually fired.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use onceflow_engine::faults::{Action, FailPoint};
use onceflow_engine::store::journal::{FailedSend, ModelCallStart};
use onceflow_engine::store::{BatchKind, Checkpoint, Fence, Held};
use onceflow_engine::testkit::{wait_until, Behaviour, TestEnv};
use onceflow_engine::{DeliveryPolicy, Engine, ErrorEnvelope, JobState, Registry};
use onceflow_workflows::Completion;
use serde_json::{json, Value};

const WAIT: Duration = Duration::from_secs(30);

fn gen_key(id: &str) -> String {
    format!("job:{id}:generate")
}

fn registry(delivery: DeliveryPolicy) -> Registry {
    let mut r = Registry::new();
    r.register(Completion::with_delivery(delivery));
    r
}

/// A fault PostgreSQL raises itself: a trigger that fails the updates of
/// `table` matching `when` with `sqlstate`, the first `times` times. A
/// sequence counts the matches outside any transaction, so a statement the
/// fault rolled back still counts as fired.
struct DbFault {
    name: String,
    times: i64,
}

static NEXT_FAULT: AtomicU64 = AtomicU64::new(0);

impl DbFault {
    async fn arm(env: &TestEnv, table: &str, when: &str, sqlstate: &str, times: i64) -> DbFault {
        let name = format!("fault_{}", NEXT_FAULT.fetch_add(1, Ordering::Relaxed));
        env.execute(&format!("CREATE SEQUENCE {name}")).await;
        env.execute(&format!(
            "CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS $f$ \
             BEGIN \
                 IF {when} THEN \
                     IF nextval('{name}') <= {times} THEN \
                         RAISE EXCEPTION 'injected {sqlstate} ({name})' USING ERRCODE = '{sqlstate}'; \
                     END IF; \
                 END IF; \
                 RETURN NEW; \
             END $f$"
        ))
        .await;
        env.execute(&format!(
            "CREATE TRIGGER {name} BEFORE UPDATE ON {table} FOR EACH ROW EXECUTE FUNCTION {name}()"
        ))
        .await;
        DbFault { name, times }
    }

    /// How many times it raised.
    async fn fired(&self, env: &TestEnv) -> i64 {
        let v = env
            .sql(&format!(
                "SELECT CASE WHEN is_called THEN last_value ELSE 0 END AS n FROM {}",
                self.name
            ))
            .await;
        v[0]["n"].as_i64().unwrap().min(self.times)
    }
}

/// A node with a 10 s lease, so no lapse can muddy a count.
fn long_lease(env: &TestEnv) -> onceflow_engine::EngineConfig {
    let mut config = env.config();
    config.lease = Duration::from_secs(10);
    config
}

/// The raw requests the consumer received for `id` (repeats included).
fn posts(env: &TestEnv, id: &str) -> usize {
    env.consumer.deliveries_for(id).len()
}

#[actix_rt::test]
async fn a_transient_error_recording_a_delivery_is_retried_in_place_and_posts_once() {
    let env = TestEnv::new().await;
    let fault = DbFault::arm(
        &env,
        "jobs",
        "OLD.state = 'claimed' AND NEW.state = 'acked'",
        "40001",
        1,
    )
    .await;
    let _engine = env.start(registry(DeliveryPolicy::AtLeastOnce), long_lease(&env));
    env.submit("rec-d", "hello").await;
    let job = env.wait_for("rec-d", JobState::Acked, WAIT).await;
    assert_eq!(fault.fired(&env).await, 1, "the fault must have fired");
    assert_eq!(posts(&env, "rec-d"), 1, "the consumer saw exactly one POST");
    assert_eq!(job.attempts, 1, "recorded in place, not rescheduled");
}

#[actix_rt::test]
async fn a_transient_error_recording_a_model_answer_is_retried_in_place_and_calls_once() {
    let env = TestEnv::new().await;
    let fault = DbFault::arm(
        &env,
        "model_calls",
        "OLD.status <> 'completed' AND NEW.status = 'completed'",
        "40001",
        1,
    )
    .await;
    let _engine = env.start(registry(DeliveryPolicy::AtLeastOnce), long_lease(&env));
    env.submit("rec-m", "hello").await;
    let job = env.wait_for("rec-m", JobState::Acked, WAIT).await;
    assert_eq!(fault.fired(&env).await, 1);
    assert_eq!(
        env.provider.requests_for(&gen_key("rec-m")),
        1,
        "the provider saw exactly one request"
    );
    assert_eq!(env.provider.requests().len(), 1);
    assert_eq!(posts(&env, "rec-m"), 1);
    assert_eq!(job.attempts, 1);
}

/// Every SQLSTATE a production database raises transiently, raised on the
/// statement that records a delivery: each is retried in place. (A trigger
/// cannot drop the connection: 08xxx raised this way exercise the
/// classification, and the next test terminates real backends.)
#[actix_rt::test]
async fn every_transient_sqlstate_is_retried_in_place() {
    const CODES: [&str; 10] = [
        "08006", "08003", "40001", "40P01", "57P01", "57P02", "57P03", "53300", "55P03", "25006",
    ];
    let env = TestEnv::new().await;
    let mut faults = Vec::new();
    for code in CODES {
        let id = format!("code-{code}");
        faults.push((
            id.clone(),
            DbFault::arm(
                &env,
                "jobs",
                &format!("NEW.id = '{id}' AND OLD.state = 'claimed' AND NEW.state = 'acked'"),
                code,
                1,
            )
            .await,
        ));
    }
    let _engine = env.start(registry(DeliveryPolicy::AtLeastOnce), long_lease(&env));
    // One job at a time: each faulted write is a batch of one, so only the
    // in-place retry (not a batch split) can save it.
    for (id, fault) in &faults {
        let retried = env.store.statements_retried();
        env.submit(id, "hello").await;
        let job = env.wait_for(id, JobState::Acked, WAIT).await;
        assert!(
            env.store.statements_retried() > retried,
            "{id}: the statement was retried in place"
        );
        assert_eq!(fault.fired(&env).await, 1, "{id}: the fault fired");
        assert_eq!(posts(&env, id), 1, "{id}: one POST");
        assert_eq!(env.provider.requests_for(&gen_key(id)), 1, "{id}");
        assert_eq!(job.attempts, 1, "{id}: no reschedule");
    }
}

/// When the in-place budget is spent the attempt is rescheduled, never
/// dead-lettered: the database failing is not the job's fault.
#[actix_rt::test]
async fn a_store_error_past_the_in_place_budget_reschedules_and_never_kills() {
    let env = TestEnv::new().await;
    let fault = DbFault::arm(
        &env,
        "jobs",
        "OLD.state = 'claimed' AND NEW.state = 'acked'",
        "40P01",
        25,
    )
    .await;
    let store = env
        .store
        .clone()
        .with_retry_budget(Duration::from_millis(150));
    let _engine = Engine::start(
        store,
        registry(DeliveryPolicy::AtLeastOnce),
        env.faults.clone(),
        long_lease(&env),
    );
    env.submit("budget-1", "hello").await;
    let job = env.wait_for("budget-1", JobState::Acked, WAIT).await;
    assert_eq!(fault.fired(&env).await, 25);
    assert!(job.attempts >= 2, "the budget ran out at least once");
    assert!(job.dead_reason.is_none());
    // At-least-once after a reschedule: repeats, all under the one key,
    // processed once.
    assert!(posts(&env, "budget-1") >= 2);
    assert_eq!(
        env.consumer.requests_with_key("job:budget-1:completed"),
        posts(&env, "budget-1")
    );
    assert_eq!(env.consumer.processed_for("budget-1"), 1);
    assert_eq!(env.provider.requests_for(&gen_key("budget-1")), 1);
}

/// The store-failure budget counts store failures, not leases: a job
/// taken over or redriven sixty times survives its first long outage.
#[actix_rt::test]
async fn a_job_with_many_earlier_attempts_survives_a_store_outage() {
    let env = TestEnv::new().await;
    let fault = DbFault::arm(
        &env,
        "jobs",
        "OLD.state = 'claimed' AND NEW.state = 'acked'",
        "40P01",
        10,
    )
    .await;
    let store = env
        .store
        .clone()
        .with_retry_budget(Duration::from_millis(150));
    env.submit("budget-old", "hello").await;
    env.execute("UPDATE jobs SET attempts = 60 WHERE id = 'budget-old'")
        .await;
    let _engine = Engine::start(
        store,
        registry(DeliveryPolicy::AtLeastOnce),
        env.faults.clone(),
        long_lease(&env),
    );
    let job = env.wait_for("budget-old", JobState::Acked, WAIT).await;
    assert_eq!(fault.fired(&env).await, 10);
    assert!(job.dead_reason.is_none(), "{:?}", job.dead_reason);
    let counted = env
        .sql("SELECT store_failures AS n FROM jobs WHERE id = 'budget-old'")
        .await;
    assert!(
        counted[0]["n"].as_i64().unwrap() >= 1,
        "the outage was counted: {counted}"
    );
    assert_eq!(env.consumer.processed_for("budget-old"), 1);
}

/// Terminating every backend mid-run (connection loss, 57P01) sends no job to
/// `dead` and repeats no model call.
#[actix_rt::test]
async fn terminating_every_backend_mid_run_kills_no_job() {
    let env = TestEnv::new().await;
    env.provider.set_latency(Duration::from_millis(200));
    let _engine = env.start(registry(DeliveryPolicy::AtLeastOnce), long_lease(&env));
    let ids: Vec<String> = (0..30).map(|i| format!("term-{i:02}")).collect();
    for id in &ids {
        env.submit(id, "hello").await;
    }
    let db_name = env.db_url.rsplit('/').next().unwrap().to_owned();
    let admin = onceflow_engine::Db::connect(&env.db_url, 1).await.unwrap();
    let mut terminated = 0i64;
    for _ in 0..6 {
        tokio::time::sleep(Duration::from_millis(150)).await;
        terminated += terminate_backends(&admin, &db_name).await;
    }
    assert!(terminated > 0, "no backend was terminated");
    for id in &ids {
        let job = env.wait_for(id, JobState::Acked, WAIT).await;
        assert!(job.dead_reason.is_none(), "{id}");
        assert_eq!(posts(&env, id), 1, "{id}: one POST");
        assert_eq!(
            env.provider.requests_for(&gen_key(id)),
            1,
            "{id}: one model request"
        );
    }
    eprintln!(
        "terminated {terminated} backends; {} statements retried in place",
        env.store.statements_retried()
    );
}

async fn terminate_backends(admin: &onceflow_engine::Db, db_name: &str) -> i64 {
    use diesel_async::RunQueryDsl;
    #[derive(diesel::QueryableByName)]
    struct N {
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        n: i64,
    }
    let mut conn = admin.conn().await.unwrap();
    let n: N = diesel::sql_query(
        "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) AS n FROM pg_stat_activity \
         WHERE datname = $1 AND pid <> pg_backend_pid()",
    )
    .bind::<diesel::sql_types::Text, _>(db_name)
    .get_result(&mut conn)
    .await
    .unwrap();
    n.n
}

/// While a group-commit statement (and the heartbeat) over several jobs is
/// open, another connection can lock none of its rows: they were all locked,
/// in id order, before the statement wrote anything.
#[actix_rt::test]
async fn batch_statements_lock_every_row_they_name_first() {
    let env = TestEnv::new().await;
    for (k, kind) in [
        BatchKind::Ack,
        BatchKind::Delivered,
        BatchKind::ModelAnswer,
        BatchKind::CommitResult,
        BatchKind::BeginCall,
        BatchKind::Renew,
    ]
    .into_iter()
    .enumerate()
    {
        let ids: Vec<String> = (0..4).map(|i| format!("lock-{k}-{i}")).collect();
        for id in &ids {
            env.submit(id, "hello").await;
        }
        let fences: Vec<Fence> = ids
            .iter()
            .map(|id| Fence {
                job_id: id.clone(),
                incarnation: 1,
                epoch: 0,
                attempt: 1,
                worker: "probe".into(),
            })
            .collect();
        let store = env.store.clone();
        let probe = actix_rt::spawn(async move {
            store
                .group_commit()
                .probe_batch_locks(kind, &fences, Duration::from_secs(2))
                .await
        });
        // Wait until the statement holds its first row, then try each.
        let first_locked = wait_until(Duration::from_secs(5), || async {
            !try_lock(&env, &ids[0]).await
        })
        .await;
        if !first_locked {
            panic!(
                "{kind:?}: the statement never locked its first row: {:?}",
                probe.await
            );
        }
        for id in &ids {
            assert!(
                !try_lock(&env, id).await,
                "{kind:?}: {id} could be locked while the batch statement was open"
            );
        }
        probe.await.unwrap().unwrap();
    }
}

/// `SELECT … FOR UPDATE NOWAIT` on one job row from a connection of its own.
async fn try_lock(env: &TestEnv, id: &str) -> bool {
    use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
    let mut conn = AsyncPgConnection::establish(&env.db_url).await.unwrap();
    diesel::sql_query("SELECT id FROM jobs WHERE id = $1 FOR UPDATE NOWAIT")
        .bind::<diesel::sql_types::Text, _>(id)
        .execute(&mut conn)
        .await
        .is_ok()
}

/// A model answer PostgreSQL cannot store (a NUL character) fails its own job
/// alone, with a clear reason, before it reaches a batch; a job answered at
/// the same moment proceeds. (A row refused inside a batch: the next test.)
#[actix_rt::test]
async fn a_model_answer_with_a_nul_fails_its_job_only() {
    let env = TestEnv::new().await;
    env.provider.respond_with(|request, n| {
        let prompt = request["messages"][0]["content"].as_str().unwrap_or_default();
        let content = if prompt == "poison" {
            "bad\u{0}answer".to_owned()
        } else {
            format!("fine {n}")
        };
        json!({
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1}
        })
    });
    let _engine = env.start(registry(DeliveryPolicy::AtLeastOnce), long_lease(&env));
    env.submit("nul-bad", "poison").await;
    env.submit("nul-good", "hello").await;
    let bad = env.wait_for("nul-bad", JobState::Dead, WAIT).await;
    let good = env.wait_for("nul-good", JobState::Acked, WAIT).await;
    assert_eq!(
        bad.last_error.as_ref().unwrap().code,
        "invalid_model_response"
    );
    assert!(!bad.last_error.as_ref().unwrap().retryable);
    assert_eq!(
        env.provider.requests_for(&gen_key("nul-bad")),
        1,
        "not retried"
    );
    assert_eq!(posts(&env, "nul-bad"), 0);
    assert!(good.result.unwrap()["content"]
        .as_str()
        .unwrap()
        .starts_with("fine "));
    assert_eq!(posts(&env, "nul-good"), 1);
}

/// A row PostgreSQL refuses inside a group commit (here a CHECK violation
/// raised for one job) fails that request alone: its batchmate commits.
#[actix_rt::test]
async fn one_refused_row_never_fails_its_batchmates() {
    let env = TestEnv::new().await;
    let fault = DbFault::arm(
        &env,
        "model_calls",
        "NEW.job_id = 'batch-bad' AND NEW.status = 'completed'",
        "23514",
        1000,
    )
    .await;
    let _engine = env.start(registry(DeliveryPolicy::AtLeastOnce), long_lease(&env));
    env.store.group_commit().seam(Held::ModelAnswers).hold(true);
    env.submit("batch-bad", "one").await;
    env.submit("batch-good", "two").await;
    // Both answers are back and queued behind the held batch.
    let both = wait_until(WAIT, || async {
        env.store.group_commit().seam(Held::ModelAnswers).queued() == 2
    })
    .await;
    assert!(both, "both answers queued behind the held batch");
    env.store
        .group_commit()
        .seam(Held::ModelAnswers)
        .hold(false);
    let bad = env.wait_for("batch-bad", JobState::Dead, WAIT).await;
    env.wait_for("batch-good", JobState::Acked, WAIT).await;
    assert!(
        env.store.group_commit().seam(Held::ModelAnswers).largest() >= 2,
        "the two answers shared a batch"
    );
    assert!(fault.fired(&env).await >= 1);
    assert!(!bad.last_error.as_ref().unwrap().retryable);
    assert_eq!(env.provider.requests_for(&gen_key("batch-good")), 1);
    assert_eq!(env.provider.requests_for(&gen_key("batch-bad")), 1);
    assert_eq!(posts(&env, "batch-good"), 1);
}

/// A small batch waits for the batch of its kind already running and grows
/// meanwhile, instead of running beside it alone: answers that come back one
/// by one while another answer's statement runs wait together, and run as
/// one statement once eight have gathered, without waiting longer (each
/// statement costs PostgreSQL a fixed ~0.3 ms, a large share of its work at
/// moderate load).
#[actix_rt::test]
async fn small_batches_wait_for_the_running_one_and_grow() {
    use diesel_async::{AsyncConnection, AsyncPgConnection};
    let env = TestEnv::new().await;
    // The first job's answer waits inside its statement for an advisory lock
    // this test holds. Its id sorts first, so a heartbeat that runs meanwhile
    // stops at its row before locking the others'.
    env.execute(
        "CREATE FUNCTION slow_answer() RETURNS trigger LANGUAGE plpgsql AS $f$ \
         BEGIN \
             IF NEW.job_id = 'grow-0-slow' AND NEW.status = 'completed' THEN \
                 PERFORM pg_advisory_xact_lock(4242); \
             END IF; \
             RETURN NEW; \
         END $f$",
    )
    .await;
    env.execute(
        "CREATE TRIGGER slow_answer BEFORE UPDATE ON model_calls \
         FOR EACH ROW EXECUTE FUNCTION slow_answer()",
    )
    .await;
    let mut gate = AsyncPgConnection::establish(&env.db_url).await.unwrap();
    diesel_async::RunQueryDsl::execute(
        diesel::sql_query("SELECT pg_advisory_lock(4242)"),
        &mut gate,
    )
    .await
    .unwrap();
    let _engine = env.start(registry(DeliveryPolicy::AtLeastOnce), long_lease(&env));
    env.submit("grow-0-slow", "slow").await;
    let waiting = wait_until(WAIT, || async {
        let v = env
            .sql(
                "SELECT pid FROM pg_stat_activity \
                 WHERE wait_event_type = 'Lock' AND wait_event = 'advisory'",
            )
            .await;
        v.as_array().is_some_and(|a| a.len() == 1)
    })
    .await;
    assert!(waiting, "the first answer's statement is running, held");
    // Three more jobs' answers come back one after another meanwhile.
    for id in ["grow-1", "grow-2", "grow-3"] {
        env.submit(id, "quick").await;
        let answered = wait_until(WAIT, || async {
            env.provider.requests_for(&gen_key(id)) == 1
        })
        .await;
        assert!(answered, "{id} answered");
    }
    // None ran alone in the free slot: all three wait, queued together, for
    // as long as the running batch runs.
    let together = wait_until(WAIT, || async {
        env.store.group_commit().seam(Held::ModelAnswers).queued() == 3
    })
    .await;
    assert!(
        together,
        "queued: {} (a small batch ran beside the running one)",
        env.store.group_commit().seam(Held::ModelAnswers).queued()
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        env.store.group_commit().seam(Held::ModelAnswers).queued(),
        3,
        "still waiting"
    );
    // Once eight have gathered they stop waiting and run beside it: the
    // eight jobs finish while the first is still held.
    let quick: Vec<String> = (1..=8).map(|i| format!("grow-{i}")).collect();
    for id in &quick[3..] {
        env.submit(id, "quick").await;
    }
    for id in &quick {
        env.wait_for(id, JobState::Acked, WAIT).await;
    }
    assert_eq!(env.job("grow-0-slow").await.state, JobState::Received);
    diesel_async::RunQueryDsl::execute(
        diesel::sql_query("SELECT pg_advisory_unlock(4242)"),
        &mut gate,
    )
    .await
    .unwrap();
    env.wait_for("grow-0-slow", JobState::Acked, WAIT).await;
    for id in quick.iter().map(String::as_str).chain(["grow-0-slow"]) {
        assert_eq!(env.provider.requests_for(&gen_key(id)), 1, "{id}");
        assert_eq!(posts(&env, id), 1, "{id}");
    }
    assert!(
        env.store.group_commit().seam(Held::ModelAnswers).largest() >= 8,
        "the eight answers went in one statement"
    );
}

/// A zombie (an attempt whose lease was taken over) can neither clear the
/// newer attempt's in-flight marks nor overwrite its journaled answer.
#[actix_rt::test]
async fn a_zombie_cannot_clear_newer_marks_or_overwrite_an_answer() {
    let env = TestEnv::new().await;
    env.submit("zombie-f", "hello").await;
    let old = env.lease("node-old", Duration::from_millis(1)).await.fence;
    let key = gen_key("zombie-f");
    let hash = "a".repeat(64);
    assert_eq!(
        env.store
            .journal()
            .begin_model_call(&old, &key, &hash, 60_000)
            .await
            .unwrap(),
        ModelCallStart::Send { attempt: 1 }
    );
    tokio::time::sleep(Duration::from_millis(20)).await;
    let new = env.lease("node-new", Duration::from_secs(30)).await.fence;
    assert!(new.epoch > old.epoch);
    assert_eq!(
        env.store
            .journal()
            .begin_model_call(&new, &key, &hash, 60_000)
            .await
            .unwrap(),
        ModelCallStart::Send { attempt: 2 }
    );
    let failed = FailedSend {
        error: ErrorEnvelope {
            code: "ambiguous".into(),
            message: "zombie".into(),
            retryable: true,
        },
        status: None,
    };
    // fail_model_call: fenced.
    assert!(!env
        .store
        .journal()
        .fail_model_call(&old, &key, &failed)
        .await
        .unwrap());
    let row = env
        .sql(&format!("SELECT in_flight_epoch, in_flight_until IS NOT NULL AS marked, last_error FROM model_calls WHERE idempotency_key = '{key}'"))
        .await;
    assert_eq!(row[0]["in_flight_epoch"], new.epoch, "{row}");
    assert_eq!(row[0]["marked"], true);
    assert_eq!(row[0]["last_error"], Value::Null);
    // The model answer: the zombie's is refused, the newer one's is kept.
    let faults = env.faults.clone();
    let answer = |s: &str| json!({"choices": [{"message": {"content": s}}]});
    assert_eq!(
        env.store
            .journal()
            .complete_model_call(&old, &key, &answer("zombie"), (Some(1), Some(1)), &faults)
            .await
            .unwrap(),
        Checkpoint::LeaseLost
    );
    assert_eq!(
        env.store
            .journal()
            .complete_model_call(&new, &key, &answer("newer"), (Some(1), Some(1)), &faults)
            .await
            .unwrap(),
        Checkpoint::Moved
    );
    let stored = env
        .sql(&format!(
            "SELECT response FROM model_calls WHERE idempotency_key = '{key}'"
        ))
        .await;
    assert_eq!(stored[0]["response"], answer("newer"));
    // fail_delivery: an outbox row in flight for the newer epoch.
    env.execute(&format!(
        "INSERT INTO outbox (job_id, event, idempotency_key, url, body, attempts, in_flight_until, in_flight_epoch) \
         VALUES ('zombie-f', 'job.completed', 'job:zombie-f:completed', 'http://127.0.0.1:9/', '{{}}', 1, \
                 now() + interval '1 minute', {})",
        new.epoch
    ))
    .await;
    assert_eq!(
        env.store
            .journal()
            .fail_delivery(&old, "job:zombie-f:completed", &failed, None)
            .await
            .unwrap(),
        Checkpoint::LeaseLost
    );
    let outbox = env
        .sql("SELECT in_flight_epoch, status::text AS status, last_error FROM outbox WHERE job_id = 'zombie-f'")
        .await;
    assert_eq!(outbox[0]["in_flight_epoch"], new.epoch, "{outbox}");
    assert_eq!(outbox[0]["status"], "claimed");
    assert_eq!(outbox[0]["last_error"], Value::Null);
    // fail_tool_call: a ledger row started by the newer epoch.
    use onceflow_engine::store::ledger::{Position, ToolCallSpec, ToolCallStart};
    let position = Position { turn: 0, index: 0 };
    let args = json!({"q": 1});
    let spec = ToolCallSpec {
        position,
        tool_call_id: "call-1",
        tool_name: "lookup",
        arguments: &args,
        arguments_hash: &hash,
        mode: onceflow_engine::rules::verdict::SendMode::AtLeastOnce,
        server: None,
    };
    assert_eq!(
        env.store
            .journal()
            .begin_tool_call(&new, &spec, 60_000)
            .await
            .unwrap(),
        ToolCallStart::Execute { attempt: 1 }
    );
    assert!(!env
        .store
        .journal()
        .fail_tool_call(
            &old,
            position,
            &failed.error,
            onceflow_engine::store::ledger::ToolFailure::Permanent
        )
        .await
        .unwrap());
    let tool = env
        .sql("SELECT in_flight_epoch, status::text AS status FROM tool_calls WHERE job_id = 'zombie-f'")
        .await;
    assert_eq!(tool[0]["in_flight_epoch"], new.epoch, "{tool}");
    assert_eq!(tool[0]["status"], "started");
}

/// At-most-once: a send that failed after it left, and the job's death,
/// commit together. A transient error on that commit is retried in place:
/// one POST, the job dead, the row `unknown`, nothing sent again.
#[actix_rt::test]
async fn at_most_once_records_a_failed_send_and_the_death_together() {
    let env = TestEnv::new().await;
    let fault = DbFault::arm(&env, "jobs", "NEW.state = 'dead'", "40001", 1).await;
    env.consumer.push(Behaviour::Status(503, None));
    let _engine = env.start(registry(DeliveryPolicy::AtMostOnce), long_lease(&env));
    env.submit("amo-fail", "hello").await;
    let job = env.wait_for("amo-fail", JobState::Dead, WAIT).await;
    assert_eq!(fault.fired(&env).await, 1);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(posts(&env, "amo-fail"), 1, "at most once");
    assert_eq!(job.delivery.unwrap().status, "unknown");
    assert_eq!(job.attempts, 1);
}

/// At-most-once after a crash mid-request: the next attempt turns the row
/// `unknown` and the job `dead` in one transaction; a transient error on it is
/// retried, the job never loops on a closed row, nothing is sent again.
#[actix_rt::test]
async fn at_most_once_after_a_crash_closes_row_and_job_together_without_spinning() {
    let env = TestEnv::new().await;
    let fault = DbFault::arm(&env, "jobs", "NEW.state = 'dead'", "40001", 1).await;
    env.faults
        .arm_once("amo-crash", FailPoint::WebhookAfterSend, Action::Crash);
    let _engine = env.start(registry(DeliveryPolicy::AtMostOnce), env.config());
    env.submit("amo-crash", "hello").await;
    let job = env.wait_for("amo-crash", JobState::Dead, WAIT).await;
    assert!(env.faults.fired("amo-crash"));
    assert_eq!(fault.fired(&env).await, 1);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(posts(&env, "amo-crash"), 1);
    assert_eq!(job.delivery.as_ref().unwrap().status, "unknown");
    assert_eq!(job.last_error.as_ref().unwrap().code, "delivery_unknown");
    assert!(job.attempts <= 3, "no loop: {} attempts", job.attempts);
}

/// A closed outbox row under a live job (left by an older build, or by hand)
/// closes the job at once instead of looping on it.
#[actix_rt::test]
async fn a_closed_outbox_row_under_a_live_job_closes_it_without_spinning() {
    let env = TestEnv::new().await;
    env.faults.arm_once(
        "closed-row",
        FailPoint::AfterCommit("claimed"),
        Action::Crash,
    );
    let config = long_lease(&env);
    let crashed = env.start(registry(DeliveryPolicy::AtMostOnce), config.clone());
    env.submit("closed-row", "hello").await;
    assert!(
        wait_until(WAIT, || async { env.faults.fired("closed-row") }).await,
        "the crash after the claim fired"
    );
    crashed.shutdown();
    // While nobody runs it (the 10 s lease holds), the row is closed by hand;
    // the node restarted under its name reclaims the job at once.
    env.execute("UPDATE outbox SET status = 'unknown' WHERE job_id = 'closed-row'")
        .await;
    let _restarted = env.start(registry(DeliveryPolicy::AtMostOnce), config);
    let job = env.wait_for("closed-row", JobState::Dead, WAIT).await;
    assert_eq!(posts(&env, "closed-row"), 0);
    assert_eq!(job.last_error.as_ref().unwrap().code, "delivery_unknown");
    assert!(job.attempts <= 3, "no loop: {} attempts", job.attempts);
}

/// One job, one actor per node: a heartbeat that fails for longer than the
/// lease does not make the node take its own job again and call the model a
/// second time.
#[actix_rt::test]
async fn a_heartbeat_failing_past_the_lease_does_not_start_a_second_actor() {
    let env = TestEnv::new().await;
    // The renewal alone: same epoch and state, a new expiry, still leased.
    let fault = DbFault::arm(
        &env,
        "jobs",
        "OLD.lease_epoch = NEW.lease_epoch AND OLD.state = NEW.state AND NEW.lease_owner IS NOT NULL \
         AND OLD.lease_expires_at IS DISTINCT FROM NEW.lease_expires_at",
        "08006",
        8,
    )
    .await;
    env.provider.set_latency(Duration::from_secs(3));
    let mut config = env.config();
    config.provider.timeout = Duration::from_secs(10);
    let engine = env.start(registry(DeliveryPolicy::AtLeastOnce), config);
    env.submit("hb-1", "hello").await;
    let job = env.wait_for("hb-1", JobState::Acked, WAIT).await;
    assert!(
        fault.fired(&env).await >= 4,
        "the heartbeat failed past the 1 s lease"
    );
    assert_eq!(
        env.provider.requests_for(&gen_key("hb-1")),
        1,
        "one request"
    );
    assert_eq!(posts(&env, "hb-1"), 1);
    assert_eq!(job.attempts, 1);
    assert_eq!(
        engine
            .counters()
            .started
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
}

/// Submits job `id` of a workflow no node registers (`not.here`): it stays live.
async fn submit_unregistered(env: &TestEnv, id: &str) {
    env.submit_job(onceflow_engine::node::intake::NewJob {
        tags: Default::default(),
        id: id.into(),
        workflow: "not.here".into(),
        workflow_version: 1,
        input: json!({}),
        webhook_url: env.consumer.url(),
        schedule: Default::default(),
    })
    .await;
}

/// A job whose workflow this node does not have is never taken by it (nor
/// dead-lettered); `/metrics` counts it as unrunnable.
#[actix_rt::test]
async fn a_job_of_an_unregistered_workflow_is_left_alone_and_counted() {
    let env = TestEnv::new().await;
    let telemetry = Arc::new(onceflow_observability::Telemetry::disabled());
    let mut config = env.config();
    config.telemetry = telemetry.clone();
    let engine = env.start(registry(DeliveryPolicy::AtLeastOnce), config);
    submit_unregistered(&env, "elsewhere-1").await;
    env.submit("here-1", "hello").await;
    env.wait_for("here-1", JobState::Acked, WAIT).await;
    let counted = wait_until(Duration::from_secs(10), || async {
        engine.refresh_gauges().await;
        telemetry
            .prometheus()
            .lines()
            .any(|l| l.starts_with("onceflow_jobs_unrunnable") && l.ends_with(" 1"))
    })
    .await;
    assert!(counted, "{}", telemetry.prometheus());
    let job = env.job("elsewhere-1").await;
    assert_eq!(job.state, JobState::Received);
    assert_eq!(job.attempts, 0, "never leased");
    assert!(job.dead_reason.is_none());
}

/// The `onceflow.jobs` gauge counts live jobs by state and the dead ones,
/// and not the acked and cancelled ones kept for the retention window (their
/// count would cost a read of the whole table at every refresh).
#[actix_rt::test]
async fn the_jobs_gauge_counts_live_and_dead_jobs_only() {
    let env = TestEnv::new().await;
    let telemetry = Arc::new(onceflow_observability::Telemetry::disabled());
    let mut config = env.config();
    config.telemetry = telemetry.clone();
    // Two live jobs no node runs, one dead, one cancelled, two acked.
    for id in [
        "gauge-live-1",
        "gauge-live-2",
        "gauge-dead",
        "gauge-cancelled",
    ] {
        submit_unregistered(&env, id).await;
    }
    env.execute(
        "UPDATE jobs SET state = 'dead', dead_reason = 'gone for good', finished_at = now() \
         WHERE id = 'gauge-dead'",
    )
    .await;
    env.store
        .jobs()
        .cancel("gauge-cancelled", "test", "not wanted")
        .await
        .expect("cancel");
    let engine = env.start(registry(DeliveryPolicy::AtLeastOnce), config);
    env.submit("gauge-acked-1", "hello").await;
    env.submit("gauge-acked-2", "hello").await;
    env.wait_for("gauge-acked-1", JobState::Acked, WAIT).await;
    env.wait_for("gauge-acked-2", JobState::Acked, WAIT).await;
    let line = |state: &str, n: u64| format!("onceflow_jobs{{onceflow_state=\"{state}\"}} {n}");
    let counted = wait_until(Duration::from_secs(10), || async {
        engine.refresh_gauges().await;
        let text = telemetry.prometheus();
        text.lines().any(|l| l == line("received", 2))
            && text.lines().any(|l| l == line("dead", 1))
            && text.lines().any(|l| l == line("claimed", 0))
    })
    .await;
    let text = telemetry.prometheus();
    assert!(counted, "{text}");
    assert!(
        !text.contains("onceflow_jobs{onceflow_state=\"acked\"}")
            && !text.contains("onceflow_jobs{onceflow_state=\"cancelled\"}"),
        "finished jobs are not gauged: {text}"
    );
}

/// A `/metrics` scrape reads the job gauges at that moment, as a Prometheus
/// collector does: no node refreshes them on a timer of its own (an idle
/// node issues no statements for them), and the scrape still shows a job
/// submitted just before it. No engine runs here at all.
#[actix_rt::test]
async fn a_scrape_reads_the_job_gauges_when_it_is_made() {
    let env = TestEnv::new().await;
    let base = crate::support::serve_api(&env, registry(DeliveryPolicy::AtLeastOnce), None);
    let gauge = |text: &str, prefix: &str| {
        text.lines()
            .find(|l| l.starts_with(prefix))
            .and_then(|l| l.rsplit(' ').next())
            .map(str::to_owned)
    };
    submit_unregistered(&env, "scraped-1").await;
    submit_unregistered(&env, "scraped-2").await;
    let text = crate::support::get_text(&format!("{base}/metrics")).await;
    assert_eq!(
        gauge(&text, "onceflow_jobs_unrunnable").as_deref(),
        Some("2"),
        "{text}"
    );
    assert_eq!(
        gauge(&text, "onceflow_jobs{onceflow_state=\"received\"}").as_deref(),
        Some("2"),
        "{text}"
    );
    env.execute("UPDATE jobs SET state = 'dead', dead_reason = 'x', finished_at = now() WHERE id = 'scraped-1'")
        .await;
    let text = crate::support::get_text(&format!("{base}/metrics")).await;
    assert_eq!(
        gauge(&text, "onceflow_jobs{onceflow_state=\"dead\"}").as_deref(),
        Some("1"),
        "the next scrape reads again: {text}"
    );
}

/// A 2xx is delivered on its status alone, even when its body cannot be read.
#[actix_rt::test]
async fn a_2xx_with_an_unreadable_body_is_delivered() {
    use std::io::{Read, Write};
    let env = TestEnv::new().await;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    let requests = Arc::new(AtomicU64::new(0));
    let seen = requests.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            seen.fetch_add(1, Ordering::SeqCst);
            let mut buf = [0u8; 65536];
            let _ = stream.read(&mut buf);
            // Promises 1000 bytes, sends 5, hangs up.
            let _ = stream.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\nshort");
        }
    });
    let _engine = env.start(registry(DeliveryPolicy::AtLeastOnce), long_lease(&env));
    env.submit_job(onceflow_engine::node::intake::NewJob {
        tags: Default::default(),
        id: "body-1".into(),
        workflow: "completion".into(),
        workflow_version: 1,
        input: json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
        webhook_url: url,
        schedule: Default::default(),
    })
    .await;
    let job = env.wait_for("body-1", JobState::Acked, WAIT).await;
    assert_eq!(requests.load(Ordering::SeqCst), 1);
    assert_eq!(job.delivery.unwrap().last_status, Some(200));
}

/// The failure's record and the job's death are one transaction: when the
/// death is refused, the record rolls back with it (two transactions would
/// leave the row looking unsent, free to be sent again).
#[actix_rt::test]
async fn a_failed_send_and_its_kill_commit_or_roll_back_together() {
    let env = TestEnv::new().await;
    env.submit("atomic-1", "hello").await;
    let fence = env.lease("node-a", Duration::from_secs(30)).await.fence;
    env.execute(&format!(
        "INSERT INTO outbox (job_id, event, idempotency_key, url, body, attempts, in_flight_until, in_flight_epoch) \
         VALUES ('atomic-1', 'job.completed', 'job:atomic-1:completed', 'http://127.0.0.1:9/', '{{}}', 1, \
                 now() + interval '1 minute', {})",
        fence.epoch
    ))
    .await;
    // The death is refused for good (a CHECK violation), once.
    let fault = DbFault::arm(&env, "jobs", "NEW.state = 'dead'", "23514", 1).await;
    let failed = FailedSend {
        error: ErrorEnvelope {
            code: "http_503".into(),
            message: "HTTP 503".into(),
            retryable: true,
        },
        status: Some(503),
    };
    let kill = onceflow_engine::store::journal::KillWith {
        reason: "delivery outcome unknown (at-most-once)",
        outbox_status: onceflow_engine::rules::verdict::OutboxStatus::Unknown,
    };
    let refused = env
        .store
        .journal()
        .fail_delivery(&fence, "job:atomic-1:completed", &failed, Some(kill))
        .await;
    assert!(refused.is_err(), "{refused:?}");
    assert_eq!(fault.fired(&env).await, 1);
    let row = env
        .sql("SELECT status::text AS status, in_flight_until IS NOT NULL AS marked, last_status FROM outbox WHERE job_id = 'atomic-1'")
        .await;
    assert_eq!(row[0]["status"], "claimed", "{row}");
    assert_eq!(row[0]["marked"], true, "the in-flight mark survives: {row}");
    assert_eq!(row[0]["last_status"], Value::Null, "{row}");
    // Once the death is allowed, both commit.
    assert_eq!(
        env.store
            .journal()
            .fail_delivery(&fence, "job:atomic-1:completed", &failed, Some(kill))
            .await
            .unwrap(),
        Checkpoint::Moved
    );
    let job = env.job("atomic-1").await;
    assert_eq!(job.state, JobState::Dead);
    assert_eq!(job.delivery.unwrap().status, "unknown");
}

/// Retries are scheduled on the database's clock, not the process's: with
/// the database's clock an hour ahead of this process (`now()` and
/// `clock_timestamp()` shadowed by a schema earlier in the engine's
/// `search_path`), a model call answered `503, Retry-After: 30` and a
/// webhook answered the same are each due about 30 s from the database's
/// now. Computed from the process's clock, they would be an hour overdue
/// and run again at once.
#[actix_rt::test]
async fn retries_are_due_on_the_databases_clock() {
    let env = TestEnv::new().await;
    env.execute("CREATE SCHEMA skew").await;
    env.execute(
        "CREATE FUNCTION skew.now() RETURNS timestamptz LANGUAGE sql STABLE \
         AS $$ SELECT pg_catalog.now() + interval '1 hour' $$",
    )
    .await;
    env.execute(
        "CREATE FUNCTION skew.clock_timestamp() RETURNS timestamptz LANGUAGE sql VOLATILE \
         AS $$ SELECT pg_catalog.clock_timestamp() + interval '1 hour' $$",
    )
    .await;
    env.execute(
        "DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET search_path = skew, pg_catalog, public', \
         current_database()); END $$",
    )
    .await;
    // The engine's own connections, opened after the change, see the skew.
    let skewed =
        onceflow_engine::Store::new(onceflow_engine::Db::connect(&env.db_url, 4).await.unwrap());
    env.provider.push(Behaviour::Status(503, Some(30)));
    env.consumer.push(Behaviour::Status(503, Some(30)));
    let mut config = long_lease(&env);
    config.model_retry.retry_after_cap = Duration::from_secs(60);
    config.webhook_retry.retry_after_cap = Duration::from_secs(60);
    let _engine = Engine::start(
        skewed,
        registry(DeliveryPolicy::AtLeastOnce),
        env.faults.clone(),
        config,
    );
    env.submit("clock-model", "hello").await;
    env.submit("clock-hook", "hello").await;
    // One job's model call and the other's webhook were answered 503
    // (which is which depends on the order of sends): both jobs are
    // released to wait for their retry.
    let sent = || {
        env.provider.requests().len()
            + env.consumer.deliveries_for("clock-model").len()
            + env.consumer.deliveries_for("clock-hook").len()
    };
    let waiting = || async {
        env.sql(
            "SELECT count(*) AS n FROM jobs WHERE attempts >= 1 AND lease_owner IS NULL \
             AND finished_at IS NULL",
        )
        .await[0]["n"]
            == json!(2)
    };
    assert!(
        wait_until(WAIT, || async { sent() == 3 && waiting().await }).await,
        "a model call and a webhook failed, and both jobs wait for their retry"
    );
    for id in ["clock-model", "clock-hook"] {
        let row = env
            .sql(&format!(
                "SELECT extract(epoch FROM run_at - (pg_catalog.now() + interval '1 hour'))::float8 \
                 AS s FROM jobs WHERE id = '{id}'"
            ))
            .await;
        let s = row[0]["s"].as_f64().unwrap();
        assert!(
            (20.0..=40.0).contains(&s),
            "{id}: due {s} s from the database's now, not about 30"
        );
    }
    let before = sent();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        sent(),
        before,
        "nothing was sent again before its Retry-After"
    );
}
