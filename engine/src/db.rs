//! The connection pool and the migrations.
//!
//! A diesel-async connection is driven by a task on the runtime that opened
//! it. actix-web runs one single-threaded runtime per worker and actors run on
//! the actix System's; a connection opened on one of those dies with it. So
//! every connection is opened on one dedicated multi-threaded runtime owned
//! by [`Db`], and any runtime may then borrow it from the pool.

use std::sync::Arc;
use std::time::Duration;

use diesel_async::pooled_connection::bb8::Pool;
use diesel_async::pooled_connection::{AsyncDieselConnectionManager, ManagerConfig};
use diesel_async::{AsyncConnection, AsyncPgConnection};
use diesel_migrations::{embed_migrations, EmbeddedMigrations, MigrationHarness};
use futures_util::FutureExt;

use crate::error::StoreError;

/// The SQL migrations in `migrations/`, embedded at build time.
pub const MIGRATIONS: EmbeddedMigrations = embed_migrations!("../migrations");

/// A pooled connection.
pub type Conn<'a> = bb8::PooledConnection<'a, AsyncDieselConnectionManager<AsyncPgConnection>>;

/// The pool plus the runtime that drives its connections.
#[derive(Clone)]
pub struct Db {
    pool: Pool<AsyncPgConnection>,
    /// Lease renewals only: a heartbeat never queues behind the actors'
    /// checkpoints, however saturated `pool` is.
    lease_pool: Pool<AsyncPgConnection>,
    /// Token lookups only: a flood of requests with bogus tokens waits here,
    /// never for the connections checkpoints and heartbeats use.
    auth_pool: Pool<AsyncPgConnection>,
    runtime: Arc<DbRuntime>,
    url: Arc<str>,
}

impl std::fmt::Debug for Db {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Db")
            .field("state", &self.pool.state())
            .finish()
    }
}

/// Owns the connection-driving runtime; shuts it down without blocking when dropped.
struct DbRuntime(Option<tokio::runtime::Runtime>);

impl Drop for DbRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

/// Opens one connection as the engine uses it: without JIT compilation.
/// The engine's statements are short, but the acquire's estimated cost
/// (per-row subplans over an estimated backlog) passes PostgreSQL's JIT
/// thresholds, and compiling it took ~0.9 s of a ~10 ms statement.
async fn open(url: &str) -> diesel::ConnectionResult<AsyncPgConnection> {
    use diesel_async::SimpleAsyncConnection;
    let mut conn = AsyncPgConnection::establish(url).await?;
    conn.batch_execute("SET jit = off")
        .await
        .map_err(|e| diesel::ConnectionError::BadConnection(e.to_string()))?;
    Ok(conn)
}

impl Db {
    /// Opens a pool of at most `max_size` connections to `url`. Fails when the
    /// database cannot be reached.
    pub async fn connect(url: &str, max_size: u32) -> Result<Self, StoreError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("onceflow-db")
            .enable_all()
            .build()
            .map_err(|e| StoreError::Migrate(Box::new(e)))?;
        let handle = runtime.handle().clone();
        // Every connection is opened on the database runtime (see above).
        let manager = || {
            let handle = handle.clone();
            let mut config = ManagerConfig::default();
            config.custom_setup = Box::new(move |url| {
                let url = url.to_owned();
                let handle = handle.clone();
                async move {
                    handle
                        .spawn(async move { open(&url).await })
                        .await
                        .unwrap_or_else(|e| {
                            Err(diesel::ConnectionError::BadConnection(e.to_string()))
                        })
                }
                .boxed()
            });
            AsyncDieselConnectionManager::new_with_config(url, config)
        };
        // No `SELECT 1` before every checkout (it was ~9 round trips per
        // job): a connection that broke fails its query, the step is
        // retried, and bb8 drops connections diesel-async marks broken.
        let pool = Pool::builder()
            .max_size(max_size)
            // Under a burst (thousands of actors finishing at once) waiting for a
            // connection is backpressure, not a failure.
            .connection_timeout(Duration::from_secs(120))
            .test_on_check_out(false)
            .build_unchecked(manager());
        // Opened on first use; one heartbeat statement runs at a time per
        // node, so two connections leave room for a reconnect.
        let lease_pool = Pool::builder()
            .max_size(2)
            .connection_timeout(Duration::from_secs(10))
            .test_on_check_out(false)
            .build_unchecked(manager());
        let auth_pool = Pool::builder()
            .max_size(4)
            .connection_timeout(Duration::from_secs(10))
            .test_on_check_out(false)
            .build_unchecked(manager());
        let db = Db {
            pool,
            lease_pool,
            auth_pool,
            runtime: Arc::new(DbRuntime(Some(runtime))),
            url: url.into(),
        };
        // Fail now, with the real reason, rather than at the first request.
        drop(db.conn().await?);
        Ok(db)
    }

    /// Borrows a connection from the pool.
    pub async fn conn(&self) -> Result<Conn<'_>, StoreError> {
        Ok(self.pool.get().await?)
    }

    /// Borrows a connection reserved for lease renewals.
    pub async fn lease_conn(&self) -> Result<Conn<'_>, StoreError> {
        Ok(self.lease_pool.get().await?)
    }

    /// Borrows a connection reserved for token lookups.
    pub async fn auth_conn(&self) -> Result<Conn<'_>, StoreError> {
        Ok(self.auth_pool.get().await?)
    }

    /// The URL this pool connects to.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Opens a dedicated connection outside the pool (LISTEN needs one of its own),
    /// driven by the database runtime like the pooled ones.
    pub async fn dedicated(&self) -> Result<AsyncPgConnection, StoreError> {
        let url = self.url.to_string();
        let handle = self.runtime_handle();
        handle
            .spawn(async move { AsyncPgConnection::establish(&url).await })
            .await
            .map_err(|e| StoreError::Migrate(Box::new(e)))?
            .map_err(StoreError::from)
    }

    /// The pool itself (for a task that must not keep the runtime alive).
    pub(crate) fn pool(&self) -> Pool<AsyncPgConnection> {
        self.pool.clone()
    }

    /// Runs `task` on the database runtime.
    pub(crate) fn spawn<F>(&self, task: F)
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        self.runtime_handle().spawn(task);
    }

    fn runtime_handle(&self) -> tokio::runtime::Handle {
        self.runtime
            .0
            .as_ref()
            .expect("the database runtime lives as long as the Db")
            .handle()
            .clone()
    }

    /// Applies every pending migration. Safe to run on every start and from
    /// several processes at once (an advisory lock serialises them).
    pub async fn migrate(&self) -> Result<Vec<String>, StoreError> {
        let url = self.url.to_string();
        // The migration harness blocks; run it on the database runtime's
        // blocking pool, never on an actix (single-threaded) runtime.
        self.runtime_handle()
            .spawn_blocking(move || run_migrations_blocking(&url))
            .await
            .map_err(|e| StoreError::Migrate(Box::new(e)))?
    }
}

fn run_migrations_blocking(url: &str) -> Result<Vec<String>, StoreError> {
    use diesel::connection::SimpleConnection;
    use diesel_async::async_connection_wrapper::AsyncConnectionWrapper;
    let mut conn: AsyncConnectionWrapper<AsyncPgConnection> =
        diesel::Connection::establish(url).map_err(StoreError::from)?;
    conn.batch_execute("SELECT pg_advisory_lock(7310585)")
        .map_err(StoreError::from)?;
    let applied = conn
        .run_pending_migrations(MIGRATIONS)
        .map(|versions| versions.iter().map(|v| v.to_string()).collect())
        .map_err(StoreError::Migrate);
    let _ = conn.batch_execute("SELECT pg_advisory_unlock(7310585)");
    applied
}

/// Makes (or updates) the application role `role` with `password` and gives
/// it what the engine needs in database `database` and nothing more: it
/// reads and writes the tables and sequences, it does not own the schema.
/// Run as the superuser after every migration, so new tables are granted.
pub async fn grant_app_role(
    admin_url: &str,
    database: &str,
    role: &str,
    password: &str,
) -> Result<(), StoreError> {
    use diesel_async::SimpleAsyncConnection;
    let plain = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if !(plain(database) && plain(role) && plain(password)) {
        return Err(StoreError::Migrate(
            "the application role's name, database and password must be plain letters, digits and _ \
             (is the password file onceflow's own?)"
                .into(),
        ));
    }
    let mut conn = AsyncPgConnection::establish(admin_url).await?;
    conn.batch_execute(&format!(
        "DO $$ BEGIN \
             IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{role}') THEN \
                 CREATE ROLE {role} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION; \
             END IF; \
         END $$; \
         ALTER ROLE {role} WITH LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION PASSWORD '{password}'; \
         GRANT CONNECT ON DATABASE {database} TO {role}; \
         GRANT USAGE ON SCHEMA public TO {role}; \
         GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role}; \
         GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO {role};"
    ))
    .await?;
    Ok(())
}

/// Creates database `name` on the server at `admin_url` unless it exists,
/// optionally as a copy of `template`.
pub async fn create_database(
    admin_url: &str,
    name: &str,
    template: Option<&str>,
) -> Result<bool, StoreError> {
    use diesel::sql_types::Text;
    use diesel_async::{RunQueryDsl, SimpleAsyncConnection};
    #[derive(diesel::QueryableByName)]
    struct Exists {
        #[diesel(sql_type = diesel::sql_types::Bool)]
        exists: bool,
    }
    let valid = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    assert!(
        valid(name) && template.is_none_or(valid),
        "database names are plain identifiers"
    );
    let mut conn = AsyncPgConnection::establish(admin_url).await?;
    let found: Exists =
        diesel::sql_query("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1) AS exists")
            .bind::<Text, _>(name)
            .get_result(&mut conn)
            .await?;
    if found.exists {
        return Ok(false);
    }
    let sql = match template {
        Some(t) => format!("CREATE DATABASE {name} TEMPLATE {t}"),
        None => format!("CREATE DATABASE {name}"),
    };
    match conn.batch_execute(&sql).await {
        Ok(()) => Ok(true),
        // Another process created it between our check and our CREATE.
        Err(diesel::result::Error::DatabaseError(_, info))
            if info.message().contains("already exists") =>
        {
            Ok(false)
        }
        Err(e) => Err(e.into()),
    }
}
