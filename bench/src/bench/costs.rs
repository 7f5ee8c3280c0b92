//! What `bench` measures besides jobs/s: the machine's commit limit taken the
//! way the field takes it (pgbench), and what each job costs — statements,
//! PostgreSQL execution time, WAL flushes, CPU of this process and of the
//! server — and the machine's own state: its cores' busy and stolen shares
//! (`/proc/stat`) and a speed gauge.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::Context as _;
use diesel::sql_types::{BigInt, Bool, Double, Text};
use diesel_async::{RunQueryDsl, SimpleAsyncConnection};
use onceflow_engine::Db;

/// Monitoring statements of the bench itself start with this comment, so
/// the per-job figures leave them out.
pub const MARK: &str = "/* bench */";

/// The durable commit limit: pgbench running one-row INSERT transactions
/// (autocommit, prepared) over `clients` independent connections for
/// `seconds`, into a table of its own. Returns commits/s as pgbench reports
/// it (excluding connection time).
pub fn pgbench_rate(pgbench: &Path, url: &str, clients: u32, seconds: u32) -> anyhow::Result<f64> {
    let script = std::env::temp_dir().join(format!("onceflow-bench-{}.sql", std::process::id()));
    std::fs::write(&script, "INSERT INTO bench_commits DEFAULT VALUES;\n")?;
    let output = Command::new(pgbench)
        .args(["--no-vacuum", "--protocol=prepared", "--client"])
        .arg(clients.to_string())
        .arg("--jobs")
        .arg(clients.min(2).to_string())
        .arg("--time")
        .arg(seconds.to_string())
        .arg("--file")
        .arg(&script)
        .arg(url)
        .output()
        .with_context(|| format!("running {}", pgbench.display()));
    let _ = std::fs::remove_file(&script);
    let output = output?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    anyhow::ensure!(
        output.status.success(),
        "pgbench failed: {}",
        String::from_utf8_lossy(&output.stderr).trim()
    );
    stdout
        .lines()
        .find_map(|l| {
            let rest = l.trim().strip_prefix("tps = ")?;
            rest.split_whitespace().next()?.parse::<f64>().ok()
        })
        .with_context(|| format!("no tps line in pgbench's output: {stdout}"))
}

/// `pgbench` of the embedded installation, else on `PATH`.
pub fn find_pgbench(embedded: Option<&onceflow_engine::pg::EmbeddedPg>) -> Option<PathBuf> {
    embedded.and_then(|pg| pg.tool("pgbench")).or_else(|| {
        std::env::split_paths(&std::env::var_os("PATH")?)
            .map(|d| d.join("pgbench"))
            .find(|p| p.is_file())
    })
}

pub async fn create_commit_table(db: &Db) -> anyhow::Result<()> {
    let mut conn = db.conn().await?;
    conn.batch_execute(
        "CREATE TABLE IF NOT EXISTS bench_commits (id bigserial PRIMARY KEY, at timestamptz DEFAULT now())",
    )
    .await?;
    Ok(())
}

pub async fn drop_commit_table(db: &Db) -> anyhow::Result<()> {
    let mut conn = db.conn().await?;
    conn.batch_execute("DROP TABLE IF EXISTS bench_commits")
        .await?;
    Ok(())
}

/// CPU time (user + system) in milliseconds.
#[derive(Debug, Clone, Copy, Default)]
pub struct Cpu {
    pub this_process: f64,
    /// Of it, the fake provider's and consumer's threads (ms on CPU, from
    /// `/proc/self/task/<tid>/schedstat`): the harness, not the engine.
    pub fakes: Option<f64>,
    /// The server: the postmaster, its live backends and its reaped children.
    pub postgres: Option<f64>,
}

/// The machine's CPU time so far, all cores together, from the `cpu` line
/// of `/proc/stat` (USER_HZ ticks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MachineTicks {
    /// Every tick counted: user, nice, system, idle, iowait, irq, softirq, steal.
    pub total: u64,
    /// Ticks the cores were not idle (nor waiting on I/O), steal included.
    pub busy: u64,
    /// Ticks a virtual machine's cores were runnable but the hypervisor ran
    /// something else: capacity the machine did not have in that time.
    pub steal: u64,
}

impl MachineTicks {
    /// Of the time from `earlier` to this reading, the share the cores were
    /// busy and the share stolen, in percent; `None` when no tick passed or
    /// a counter ran backwards (some kernels' idle and iowait can).
    pub fn since(&self, earlier: &MachineTicks) -> Option<(f64, f64)> {
        let total = self.total.checked_sub(earlier.total).filter(|&t| t > 0)? as f64;
        let busy = self.busy.checked_sub(earlier.busy)? as f64;
        let steal = self.steal.checked_sub(earlier.steal)? as f64;
        Some((100.0 * busy / total, 100.0 * steal / total))
    }
}

/// Parses the first (`cpu `, all cores) line of `/proc/stat`. Kernels older
/// than 2.6.11 have no steal field: then it is 0.
pub fn parse_proc_stat(stat: &str) -> Option<MachineTicks> {
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let f: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(|v| v.parse().ok())
        .collect::<Option<_>>()?;
    // guest and guest_nice (fields 9 and 10) are already inside user and nice.
    let at = |i: usize| f.get(i).copied().unwrap_or(0);
    let total: u64 = (0..8).map(at).sum();
    let (idle, iowait) = (*f.get(3)?, at(4));
    Some(MachineTicks {
        total,
        busy: total - idle - iowait,
        steal: at(7),
    })
}

/// The machine's CPU time so far, or `None` where `/proc/stat` is missing.
pub fn machine_ticks() -> Option<MachineTicks> {
    parse_proc_stat(&std::fs::read_to_string("/proc/stat").ok()?)
}

/// How fast this machine's cores are at the moment, as one workload sees
/// it: the milliseconds a fixed single-thread computation (generating and
/// sorting four million 64-bit numbers in a buffer allocated beforehand, so
/// page faults are not timed) takes, the best of five. On a virtual machine
/// the same work can take markedly longer in one hour than in another;
/// `bench` runs it before and after its phases, beside the other figures of
/// the run. It gauges one kind of work, not the engine's.
pub fn cpu_gauge_ms() -> f64 {
    let mut buffer = vec![0u64; GAUGE_NUMBERS];
    gauge_work(&mut buffer); // touches every page before the timed passes
    (0..5)
        .map(|_| {
            let start = std::time::Instant::now();
            std::hint::black_box(gauge_work(std::hint::black_box(&mut buffer)));
            start.elapsed().as_secs_f64() * 1000.0
        })
        .fold(f64::INFINITY, f64::min)
}

/// How many numbers the gauge sorts: 100–120 ms a pass on this project's
/// 2-core development machine.
const GAUGE_NUMBERS: usize = 1 << 22;

/// The gauge's work: fills `v` with the same pseudo-random numbers
/// (xorshift) every time and sorts them; returns the median, so nothing can
/// be optimised away.
fn gauge_work(v: &mut [u64]) -> u64 {
    let mut x = 0x9E37_79B9_7F4A_7C15_u64;
    for slot in v.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *slot = x;
    }
    v.sort_unstable();
    v[v.len() / 2]
}

/// `/proc` reports CPU time in USER_HZ ticks, which Linux fixes at 100 per
/// second for user space whatever the kernel's own tick rate.
pub const TICKS_PER_SEC: f64 = 100.0;

/// (ppid, utime + stime, cutime + cstime) of a process, in ticks.
pub fn proc_times(pid: &str) -> Option<(u32, u64, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which may contain spaces: state is 3rd.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let n = |i: usize| f.get(i - 3).and_then(|v| v.parse::<u64>().ok());
    Some((n(4)? as u32, n(14)? + n(15)?, n(16)? + n(17)?))
}

/// CPU used so far by this process and by the server whose postmaster is `postmaster`.
pub fn cpu_now(postmaster: Option<u32>) -> Cpu {
    let tick_ms = 1000.0 / TICKS_PER_SEC;
    let this_process = proc_times("self").map_or(0.0, |(_, own, _)| own as f64 * tick_ms);
    let postgres = postmaster.and_then(|pm| {
        let (_, own, reaped) = proc_times(&pm.to_string())?;
        let mut ticks = own + reaped;
        for entry in std::fs::read_dir("/proc").ok()?.flatten() {
            let name = entry.file_name();
            let Some(pid) = name
                .to_str()
                .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
            else {
                continue;
            };
            if let Some((ppid, own, _)) = proc_times(pid) {
                if ppid == pm {
                    ticks += own;
                }
            }
        }
        Some(ticks as f64 * tick_ms)
    });
    Cpu {
        this_process,
        fakes: threads_cpu_ms(&onceflow_engine::testkit::fake_server_threads()),
        postgres,
    }
}

/// Time on CPU (ms) of these threads of this process, from their
/// `schedstat` (nanoseconds, user and system); `None` when none of them can
/// be read (no such threads, or a kernel without scheduler statistics). A
/// thread that has exited counts nothing from then on; the fakes' threads
/// live as long as the run.
pub fn threads_cpu_ms(tids: &[u32]) -> Option<f64> {
    let read: Vec<u64> = tids
        .iter()
        .filter_map(|tid| thread_cpu_ns(&format!("self/task/{tid}")))
        .collect();
    (!read.is_empty()).then(|| read.iter().sum::<u64>() as f64 / 1e6)
}

/// A thread's time on CPU (ns): the first field of `/proc/{thread}/schedstat`,
/// `thread` being `self/task/<tid>` or `thread-self`.
fn thread_cpu_ns(thread: &str) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{thread}/schedstat"))
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Statement counts from `pg_stat_statements`, when the server loads it.
pub struct Statements {
    pub calls: i64,
    pub exec_ms: f64,
    /// Planning time, when the server tracks it
    /// (`pg_stat_statements.track_planning`; `bench` turns it on for its own
    /// database on the embedded server).
    pub plan_ms: Option<f64>,
    /// The costliest statements: calls, total execution ms, total planning
    /// ms (when tracked), text.
    pub top: Vec<(i64, f64, Option<f64>, String)>,
}

/// Creates the extension and clears its counters; `false` when the server
/// does not load it (`shared_preload_libraries`).
pub async fn reset_statements(db: &Db) -> bool {
    let Ok(mut conn) = db.conn().await else {
        return false;
    };
    conn.batch_execute(
        "CREATE EXTENSION IF NOT EXISTS pg_stat_statements; SELECT pg_stat_statements_reset()",
    )
    .await
    .is_ok()
}

pub async fn read_statements(db: &Db) -> anyhow::Result<Statements> {
    #[derive(diesel::QueryableByName)]
    struct Row {
        #[diesel(sql_type = BigInt)]
        calls: i64,
        #[diesel(sql_type = Double)]
        ms: f64,
        #[diesel(sql_type = Double)]
        plan_ms: f64,
        #[diesel(sql_type = Bool)]
        planning_tracked: bool,
        #[diesel(sql_type = Text)]
        query: String,
    }
    let mut conn = db.conn().await?;
    let rows: Vec<Row> = diesel::sql_query(format!(
        "{MARK} SELECT calls, total_exec_time AS ms, total_plan_time AS plan_ms, \
             current_setting('pg_stat_statements.track_planning')::bool AS planning_tracked, \
             query FROM pg_stat_statements \
         WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) \
           AND query NOT LIKE '{MARK}%' AND query NOT LIKE '%pg_stat_statements%' \
         ORDER BY total_exec_time DESC"
    ))
    .load(&mut conn)
    .await?;
    // (`as_slice`: on the `Vec` itself, `first` is `RunQueryDsl::first`.)
    let tracked = rows.as_slice().first().is_some_and(|r| r.planning_tracked);
    Ok(Statements {
        calls: rows.iter().map(|r| r.calls).sum(),
        exec_ms: rows.iter().map(|r| r.ms).sum(),
        plan_ms: tracked.then(|| rows.iter().map(|r| r.plan_ms).sum()),
        top: rows
            .into_iter()
            .take(8)
            .map(|r| (r.calls, r.ms, tracked.then_some(r.plan_ms), r.query))
            .collect(),
    })
}

/// A statement's text shortened to one line for the report.
pub fn one_line(query: &str, width: usize) -> String {
    let flat: String = query.split_whitespace().collect::<Vec<_>>().join(" ");
    if flat.chars().count() <= width {
        flat
    } else {
        format!("{}…", flat.chars().take(width - 1).collect::<String>())
    }
}

/// In the id of each job of a paced phase's lead-in (no `_` or `%`: it is
/// matched with `LIKE`).
pub(super) const LEAD_IN_TAG: &str = "-lead-";

/// How long to let pgbench run at each client count.
pub const PGBENCH_TIME: Duration = Duration::from_secs(5);

/// Where a job's time goes between its checkpoints, from the journal's own
/// timestamps: p50 and p99 in ms of each stage over the jobs whose ids match
/// `pattern`, a paced phase's lead-in (ids with [`LEAD_IN_TAG`]) left out as
/// in its latencies (`None` for a stage no job of the phase reached). A stage ends
/// when the batch statement that journals its end began (the model-call
/// row's `created_at` and `updated_at` are `now()`) or wrote the history row
/// (`clock_timestamp()`): the wait for a batch to start counts in the stage
/// it ends. The bench's workflow makes one model call per job and is never
/// redriven, so each job has one of each.
pub(super) async fn stages(
    db: &onceflow_engine::Db,
    pattern: &str,
) -> anyhow::Result<[Option<(f64, f64)>; STAGES.len()]> {
    #[derive(diesel::QueryableByName)]
    struct Stage {
        #[diesel(sql_type = diesel::sql_types::Integer)]
        n: i32,
        #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Double>)]
        p50: Option<f64>,
        #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Double>)]
        p99: Option<f64>,
    }
    let mut conn = db.conn().await?;
    let rows: Vec<Stage> = diesel::sql_query(
        "/* bench */ WITH h AS ( \
             SELECT job_id, \
                 max(at) FILTER (WHERE state = 'received') AS received, \
                 max(at) FILTER (WHERE state = 'claimed') AS claimed, \
                 max(at) FILTER (WHERE state = 'delivered') AS delivered \
             FROM job_history WHERE job_id LIKE $1 AND job_id NOT LIKE $2 GROUP BY job_id), \
         m AS (SELECT job_id, min(created_at) AS began, max(updated_at) AS answered \
             FROM model_calls WHERE job_id LIKE $1 AND job_id NOT LIKE $2 GROUP BY job_id), \
         d AS (SELECT ARRAY[m.began - h.received, m.answered - m.began, \
                 h.claimed - m.answered, h.delivered - h.claimed] AS spans \
             FROM h JOIN m USING (job_id)), \
         s AS (SELECT n::int AS n, extract(epoch FROM span) * 1000 AS ms \
             FROM d, unnest(d.spans) WITH ORDINALITY AS u(span, n)) \
         SELECT n, percentile_cont(0.5) WITHIN GROUP (ORDER BY ms) AS p50, \
             percentile_cont(0.99) WITHIN GROUP (ORDER BY ms) AS p99 \
         FROM s GROUP BY n ORDER BY n",
    )
    .bind::<diesel::sql_types::Text, _>(pattern)
    .bind::<diesel::sql_types::Text, _>(format!("%{LEAD_IN_TAG}%"))
    .load(&mut conn)
    .await?;
    let mut out = [None; STAGES.len()];
    for r in rows {
        let slot = usize::try_from(r.n)
            .ok()
            .and_then(|n| n.checked_sub(1))
            .and_then(|i| out.get_mut(i));
        if let (Some(slot), Some(p50), Some(p99)) = (slot, r.p50, r.p99) {
            *slot = Some((p50, p99));
        }
    }
    Ok(out)
}

/// The stages [`stages`] measures, in order.
pub(super) const STAGES: [&str; 4] = [
    "received → model call journaled",
    "model call → answer journaled",
    "answer → result committed (claimed)",
    "claimed → delivered (webhook POST)",
];

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    /// The busy and stolen shares come from the right fields of the `cpu`
    /// line (user nice system idle iowait irq softirq steal guest guest_nice).
    #[test]
    fn proc_stat_gives_busy_and_stolen_shares() {
        let earlier = parse_proc_stat(
            "cpu  100 0 50 800 10 0 5 35 7 0\ncpu0 50 0 25 400 5 0 2 18 3 0\nintr 1 2\n",
        )
        .expect("parses");
        assert_eq!(
            earlier,
            MachineTicks {
                total: 1000,
                busy: 190,
                steal: 35
            }
        );
        // 1,000 ticks later: 300 idle, 100 user, 100 system, 100 iowait, 400 stolen.
        let later = parse_proc_stat("cpu  200 0 150 1100 110 0 5 435 7 0\n").expect("parses");
        assert_eq!(later.since(&earlier), Some((60.0, 40.0)));
        // No time passed: no shares rather than a division by zero.
        assert_eq!(earlier.since(&earlier), None);
        // An old kernel's line without steal.
        let old = parse_proc_stat("cpu  10 0 5 80 5\n").expect("parses");
        assert_eq!((old.total, old.busy, old.steal), (100, 15, 0));
        assert_eq!(parse_proc_stat("intr 1 2\n"), None);
        assert_eq!(parse_proc_stat("cpu  x y\n"), None);
    }

    /// The gauge's work is fixed and really done: every pass over the
    /// buffer, whatever it held, yields the same numbers, sorted, and the
    /// value returned is their median.
    #[test]
    fn the_cpu_gauge_does_fixed_work() {
        let n = 1 << 12;
        let mut first = vec![0u64; n];
        let median = gauge_work(&mut first);
        assert!(first.windows(2).all(|w| w[0] <= w[1]), "sorted");
        assert_eq!(first.iter().filter(|&&v| v < median).count(), n / 2);
        let mut again = vec![u64::MAX; n];
        assert_eq!(gauge_work(&mut again), median);
        assert_eq!(again, first, "the same numbers each pass");
    }

    /// The fakes' threads are the ones that do their work: starting a fake
    /// consumer records its System's thread and its two workers and no
    /// other; CPU burnt on this (a client's) thread does not show in their
    /// figure, and requests to the consumer do.
    #[test]
    fn the_fakes_cpu_is_read_from_their_own_threads() {
        let earlier = onceflow_engine::testkit::fake_server_threads();
        let consumer = onceflow_engine::testkit::FakeConsumer::start();
        let url = consumer.url();
        let addr = url
            .trim_start_matches("http://")
            .split('/')
            .next()
            .expect("host:port")
            .to_owned();
        let body = r#"{"type":"job.completed","data":{"job_id":"cpu-test"}}"#;
        let post = |n: usize| {
            for _ in 0..n {
                let mut s = std::net::TcpStream::connect(&addr).expect("connect");
                write!(
                    s,
                    "POST /hooks/completed HTTP/1.1\r\nHost: {addr}\r\n\
                     Content-Type: application/json\r\nContent-Length: {}\r\n\
                     Connection: close\r\n\r\n{body}",
                    body.len()
                )
                .expect("send");
                let mut answer = String::new();
                s.read_to_string(&mut answer).expect("answer");
                assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
            }
        };
        // The workers note themselves as they start; they have once
        // connections have reached them.
        post(20);
        let threads: Vec<u32> = onceflow_engine::testkit::fake_server_threads()
            .into_iter()
            .filter(|t| !earlier.contains(t))
            .collect();
        let mut names: Vec<String> = threads
            .iter()
            .map(|t| {
                std::fs::read_to_string(format!("/proc/self/task/{t}/comm"))
                    .expect("a thread of this process")
                    .trim()
                    .to_owned()
            })
            .collect();
        names.sort();
        assert_eq!(
            names,
            ["actix-rt|system", "actix-rt|system", "fake-consumer"],
            "the consumer's System thread and its two workers: {threads:?}"
        );

        // This thread's own CPU is not the fakes'.
        let fakes_before = threads_cpu_ms(&threads).expect("schedstat");
        let mine = thread_cpu_ns("thread-self").expect("schedstat");
        let mut x = 0u64;
        while thread_cpu_ns("thread-self").expect("schedstat") < mine + 30_000_000 {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
        }
        let fakes_idle = threads_cpu_ms(&threads).expect("schedstat") - fakes_before;
        assert!(
            fakes_idle < 10.0,
            "30 ms burnt on this thread showed as {fakes_idle} ms of the fakes'"
        );

        let before = threads_cpu_ms(&threads).expect("schedstat");
        post(200);
        assert_eq!(consumer.delivery_count(), 220);
        let after = threads_cpu_ms(&threads).expect("schedstat");
        assert!(
            after > before,
            "200 requests cost the fakes' threads CPU: {before} → {after} ms"
        );
    }
}
