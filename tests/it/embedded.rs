//! The schema and the embedded PostgreSQL.

use onceflow_engine::testkit::{database, TestEnv};
use onceflow_engine::{db, Db, Store};

#[actix_rt::test]
async fn migrations_apply_on_an_empty_database_and_again_without_error() {
    let pg = database::embedded();
    let name = format!("empty_{}", std::process::id());
    assert!(db::create_database(&pg.url("postgres"), &name, None)
        .await
        .unwrap());
    let db = Db::connect(&pg.url(&name), 2).await.unwrap();
    let store = Store::new(db.clone());
    assert!(
        !store.healthy().await.unwrap(),
        "an empty database is not healthy"
    );
    let applied = db.migrate().await.unwrap();
    let embedded =
        diesel::migration::MigrationSource::<diesel::pg::Pg>::migrations(&db::MIGRATIONS)
            .unwrap()
            .len();
    assert_eq!(applied.len(), embedded, "{applied:?}");
    assert!(store.healthy().await.unwrap());
    // A restart runs them again: nothing to do, no error.
    assert!(db.migrate().await.unwrap().is_empty());
}

#[actix_rt::test]
async fn the_schema_holds_its_invariants() {
    let env = TestEnv::new().await;
    env.submit("inv-1", "hi").await;
    // Each of these must be refused by the database itself.
    let refused = [
        "INSERT INTO jobs (id, workflow, request, request_hash) VALUES ('bad id', 'w', '{}', repeat('a', 64))",
        "UPDATE jobs SET state = 'dead' WHERE id = 'inv-1'",
        "UPDATE jobs SET state = 'acked' WHERE id = 'inv-1'",
        "UPDATE jobs SET lease_owner = 'n' WHERE id = 'inv-1'",
        "UPDATE job_history SET worker = 'x' WHERE job_id = 'inv-1'",
        "INSERT INTO results (job_id, output) VALUES ('missing', '{}')",
        "INSERT INTO model_calls (job_id, idempotency_key, request_hash, status) VALUES ('inv-1', 'k', repeat('a', 64), 'completed')",
    ];
    for sql in refused {
        use diesel_async::RunQueryDsl;
        let mut conn = env.store.db().conn().await.unwrap();
        let result = diesel::sql_query(sql).execute(&mut conn).await;
        assert!(result.is_err(), "the schema accepted: {sql}");
    }
    env.execute("INSERT INTO model_calls (job_id, idempotency_key, request_hash) VALUES ('inv-1', 'k', repeat('a', 64))")
        .await;
    {
        use diesel_async::RunQueryDsl;
        let mut conn = env.store.db().conn().await.unwrap();
        let dup = diesel::sql_query(
            "INSERT INTO model_calls (job_id, idempotency_key, request_hash) VALUES ('inv-1', 'k', repeat('b', 64))",
        )
        .execute(&mut conn)
        .await;
        assert!(dup.is_err(), "a duplicate model-call key was accepted");
    }
}

#[test]
fn a_data_directory_the_service_user_cannot_reach_fails_with_the_fix() {
    use std::os::unix::fs::PermissionsExt;
    let private = tempfile::Builder::new()
        .prefix("onceflow-private-")
        .tempdir_in("/tmp")
        .unwrap();
    std::fs::set_permissions(private.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    let data = private.path().join("data");
    let result = onceflow_engine::pg::EmbeddedPg::start(&data);
    if nix::unistd::geteuid().is_root() {
        // As root the server runs as `postgres`, which cannot enter a 0700 folder of root's.
        let message = result.expect_err("must refuse").to_string();
        assert!(message.contains("cannot enter"), "{message}");
        assert!(
            message.contains(&private.path().display().to_string()),
            "{message}"
        );
        assert!(
            message.contains("chmod o+x") && message.contains("ONCEFLOW_DATA_DIR"),
            "{message}"
        );
    } else {
        // A normal user runs the server itself and owns the folder.
        let pg = result.expect("a normal user's own folder works");
        pg.stop().unwrap();
    }
}

/// A password file planted in the data folder before the first start is
/// refused (the file is created exclusively), and so is a folder other users
/// may write to.
#[test]
fn a_planted_password_file_or_a_shared_folder_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::Builder::new()
        .prefix("onceflow-planted-")
        .tempdir_in("/tmp")
        .unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir(&data).unwrap();
    std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::write(data.join("pg.password"), "attacker-chosen").unwrap();
    let message = onceflow_engine::pg::EmbeddedPg::start(&data)
        .expect_err("must refuse the planted file")
        .to_string();
    assert!(message.contains("pg.password"), "{message}");
    assert!(message.contains("already exists"), "{message}");
    assert!(
        !data.join("pg/PG_VERSION").exists(),
        "no server was initialised with it"
    );

    let shared = dir.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).unwrap();
    let message = onceflow_engine::pg::EmbeddedPg::start(&shared)
        .expect_err("must refuse a world-writable folder")
        .to_string();
    assert!(
        message.contains("other users may create files"),
        "{message}"
    );
    assert!(message.contains("chmod go-w"), "{message}");
    assert!(
        !shared.join("pg.password").exists(),
        "no secret written there"
    );
}
