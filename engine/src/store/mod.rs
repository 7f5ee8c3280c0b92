//! All SQL lives here. Actors, workflows and the API call intention-revealing
//! methods; every transition is one guarded statement committed together with
//! its history row and the data it depends on.
//!
//! * [`jobs`]: intake (race-safe, decided by `INSERT … ON CONFLICT`) and the job view.
//! * [`lease`]: taking runnable jobs (`FOR UPDATE SKIP LOCKED`), batched heartbeats,
//!   fenced checkpoints.
//! * [`journal`]: model calls, results and the webhook outbox.
//! * [`ledger`]: the tool ledger, the general step journal, retention purges.
//! * [`sql`]: hand-written statements whose prepared form is cached.
//! * `batch`, `batched`: group commit — `delivered`, `acked` and model answers
//!   from many actors written by one statement and one commit.

mod batch;
mod batched;
pub mod jobs;
pub mod journal;
pub mod lease;
pub mod ledger;
pub mod sql;

use diesel::sql_types::{Integer, Text};
use diesel_async::RunQueryDsl;
use sql::sql;

use crate::db::Db;
use crate::error::StoreError;

pub use jobs::{DeliveryView, HistoryEntry, Intake, JobView};
pub use lease::{Checkpoint, Fence, Leased};

/// The Postgres store.
#[derive(Debug, Clone)]
pub struct Store {
    db: Db,
    batches: std::sync::Arc<batched::Batches>,
}

impl Store {
    /// A store on `db`; starts its batching tasks on the database runtime.
    pub fn new(db: Db) -> Self {
        let batches = batched::Batches::start(&db);
        Store { db, batches }
    }

    pub fn db(&self) -> &Db {
        &self.db
    }

    /// True when the database answers and the schema is migrated.
    pub async fn healthy(&self) -> Result<bool, StoreError> {
        #[derive(diesel::QueryableByName)]
        struct Found {
            #[diesel(sql_type = Integer)]
            n: i32,
        }
        let mut conn = self.db.conn().await?;
        let found: Found =
            sql("SELECT count(*)::int AS n FROM pg_catalog.pg_tables WHERE tablename = $1")
                .bind::<Text, _>("jobs")
                .get_result(&mut conn)
                .await?;
        Ok(found.n == 1)
    }
}
