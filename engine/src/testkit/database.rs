//! Real PostgreSQL for tests: one throwaway server per test process (started
//! on first use, stopped and deleted when the process exits), and a fresh
//! database per test cloned from a migrated template (about 80 ms).
//!
//! There is no skipping: without PostgreSQL binaries the first test fails
//! loudly with the launcher's install hint.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use crate::db::{create_database, Db};
use crate::pg::EmbeddedPg;

const TEMPLATE: &str = "onceflow_template";

struct Server {
    pg: EmbeddedPg,
}

static SERVER: OnceLock<Server> = OnceLock::new();
static NEXT: AtomicU64 = AtomicU64::new(0);
static CREATE_LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn server() -> &'static Server {
    SERVER.get_or_init(|| {
        // Runs on a thread of its own: the caller may be inside any runtime.
        std::thread::spawn(|| {
            let pg = EmbeddedPg::throwaway()
                .unwrap_or_else(|e| panic!("cannot start the test PostgreSQL: {e}"));
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async {
                create_database(&pg.url("postgres"), TEMPLATE, None)
                    .await
                    .expect("create the template database");
                let db = Db::connect(&pg.url(TEMPLATE), 1)
                    .await
                    .expect("connect to the template");
                db.migrate().await.expect("migrate the template");
            });
            Server { pg }
        })
        .join()
        .expect("test PostgreSQL start-up panicked")
    })
}

/// The throwaway server of this test process.
pub fn embedded() -> &'static EmbeddedPg {
    &server().pg
}

/// A URL to a new, migrated, empty database of its own.
pub async fn fresh() -> String {
    let pg = &server().pg;
    let name = format!(
        "t_{}_{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    );
    // CREATE DATABASE … TEMPLATE needs the template free of other sessions:
    // one at a time, retrying while the template's last session closes.
    let _guard = CREATE_LOCK.lock().await;
    let mut tries = 0;
    loop {
        match create_database(&pg.url("postgres"), &name, Some(TEMPLATE)).await {
            Ok(_) => break,
            Err(e) if tries < 50 && e.to_string().contains("being accessed by other users") => {
                tries += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("cannot create test database {name}: {e}"),
        }
    }
    pg.url(&name)
}
