//! The embedded PostgreSQL: a real server started from the machine's own
//! binaries, so `onceflow serve` and the tests need no database set up by hand.
//!
//! * [`EmbeddedPg::start`] keeps its data in a directory that outlives the
//!   process. It is initialised once and reused on every later start: when a
//!   previous `serve` was SIGKILLed and the server still runs, it is adopted;
//!   when it crashed, `pg_ctl start` runs crash recovery.
//! * [`EmbeddedPg::throwaway`] starts a server in a fresh temporary directory
//!   that is stopped and deleted when the owning process exits (a reaper
//!   process waits for the end of a pipe held by this process).
//!
//! `initdb` and `postgres` refuse to run as root; as root the server runs as
//! the unprivileged `postgres` user, which must be able to enter every folder
//! above the data directory. It listens on a loopback TCP port only (Unix
//! sockets are off) and requires a password generated at `initdb` time.

use std::fs;
use std::io::Write;
use std::net::TcpListener;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::error::PgError;

/// The database role initdb creates (migrations run as it).
const SUPERUSER: &str = "onceflow";
/// The role the application connects as: not a superuser; it may read and
/// write the tables, not change the schema or the server.
pub const APP_ROLE: &str = "onceflow_app";
/// The system user the server runs as when we are root.
const SERVICE_USER: &str = "postgres";

/// A running PostgreSQL server we started (or adopted). `Debug` shows no password.
pub struct EmbeddedPg {
    bin_dir: PathBuf,
    data_dir: PathBuf,
    port: u16,
    password: String,
    /// The application role's password (`None` for a throwaway test server).
    app_password: Option<String>,
    run_as: Option<RunAs>,
    /// False when we adopted a server that was already running.
    started_here: bool,
    /// Keeps the reaper's stdin open; the reaper stops the server when it closes.
    _reaper: Option<std::process::ChildStdin>,
}

impl std::fmt::Debug for EmbeddedPg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmbeddedPg")
            .field("data_dir", &self.data_dir)
            .field("port", &self.port)
            .field("started_here", &self.started_here)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Clone, Copy)]
struct RunAs {
    uid: u32,
    gid: u32,
}

/// Durability of a server: `Durable` for `serve`, `Fast` (fsync off) for throwaway test servers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// PostgreSQL's defaults: every commit is flushed to disk.
    Durable,
    /// `fsync`, `synchronous_commit` and `full_page_writes` off: a crash of the machine loses data.
    Fast,
}

impl EmbeddedPg {
    /// Starts (or adopts) the server whose data lives in `root/pg`.
    pub fn start(root: &Path) -> Result<Self, PgError> {
        fs::create_dir_all(root).map_err(|e| PgError::io(root, e))?;
        let root = root.canonicalize().map_err(|e| PgError::io(root, e))?;
        let bin_dir = find_bin_dir()?;
        let run_as = service_user()?;
        // The folder holds the server's passwords: nobody else may plant or
        // swap a file in it.
        check_private_folder(&root, run_as)?;
        let data_dir = root.join("pg");
        let password_file = root.join("pg.password");
        let app_password_file = root.join("pg.app-password");

        if !data_dir.join("PG_VERSION").exists() {
            prepare_dir(&root, &data_dir, run_as)?;
            let password = random_password();
            write_private(&password_file, &password)?;
            initdb(&bin_dir, &data_dir, &password, run_as)?;
        }
        let password = read_private(&password_file)?;
        // Installations from before the application role get one now.
        if fs::symlink_metadata(&app_password_file).is_err() {
            write_private(&app_password_file, &random_password())?;
        }
        let app_password = read_private(&app_password_file)?;

        let mut pg = EmbeddedPg {
            bin_dir,
            data_dir,
            port: 0,
            password,
            app_password: Some(app_password),
            run_as,
            started_here: false,
            _reaper: None,
        };
        match pg.running_port() {
            Some(port) => {
                tracing::info!(port, data_dir = %pg.data_dir.display(), "adopting running embedded PostgreSQL");
                pg.port = port;
            }
            None => {
                pg.port = free_port()?;
                pg.pg_ctl_start(Durability::Durable)?;
                pg.started_here = true;
            }
        }
        Ok(pg)
    }

    /// Starts a fresh server in a temporary directory, stopped and removed when
    /// this process exits (however it exits).
    pub fn throwaway() -> Result<Self, PgError> {
        let bin_dir = find_bin_dir()?;
        let run_as = service_user()?;
        let root = tempfile::Builder::new()
            .prefix("onceflow-pg-")
            .tempdir_in(std::env::temp_dir())
            .map_err(|e| PgError::io(&std::env::temp_dir(), e))?
            .keep();
        let data_dir = root.join("pg");
        prepare_dir(&root, &data_dir, run_as)?;
        let password = random_password();
        initdb(&bin_dir, &data_dir, &password, run_as)?;
        let mut pg = EmbeddedPg {
            bin_dir,
            data_dir,
            port: free_port()?,
            password,
            app_password: None,
            run_as,
            started_here: true,
            _reaper: None,
        };
        pg.pg_ctl_start(Durability::Fast)?;

        // The reaper outlives us by design: it blocks reading its stdin, which
        // only this process holds; when we exit the pipe closes and it stops
        // the server and deletes the directory.
        // pg_ctl refuses root like initdb: as root, the reaper drops to the
        // service user for `pg_ctl stop` and keeps root only for the final rm.
        let as_user = run_as
            .map(|u| {
                format!(
                    "setpriv --reuid={} --regid={} --clear-groups ",
                    u.uid, u.gid
                )
            })
            .unwrap_or_default();
        let script = format!(
            r#"read _ignored; {as_user}"$0" stop -D "$1" -m immediate >/dev/null 2>&1; rm -rf "$2""#
        );
        let mut reaper = Command::new("sh");
        reaper
            .arg("-c")
            .arg(script)
            .arg(pg.bin_dir.join("pg_ctl"))
            .arg(&pg.data_dir)
            .arg(&root);
        let mut child = reaper
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .map_err(|e| PgError::Spawn("sh".into(), e))?;
        pg._reaper = child.stdin.take();
        Ok(pg)
    }

    /// A client program of this installation (`pgbench`, `psql`), if present.
    pub fn tool(&self, name: &str) -> Option<PathBuf> {
        Some(self.bin_dir.join(name)).filter(|p| p.is_file())
    }

    /// The server's main process id (from `postmaster.pid`).
    pub fn postmaster_pid(&self) -> Option<u32> {
        let pid_file = fs::read_to_string(self.data_dir.join("postmaster.pid")).ok()?;
        pid_file.lines().next()?.trim().parse().ok()
    }

    /// Whether the installation ships server library `name` (`pkglibdir`).
    fn has_library(&self, name: &str) -> bool {
        self.bin_dir
            .parent()
            .is_some_and(|root| root.join("lib").join(format!("{name}.so")).is_file())
    }

    /// The loopback port the server listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// True when this process started the server (false: it adopted a running one).
    pub fn started_here(&self) -> bool {
        self.started_here
    }

    /// The data directory.
    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// A connection URL for `database` as the application role (see
    /// [`APP_ROLE`]; [`grant_app_role`](crate::db::grant_app_role) makes it);
    /// `None` for a throwaway test server, which has only its superuser.
    pub fn app_url(&self, database: &str) -> Option<String> {
        self.app_password.as_ref().map(|password| {
            format!(
                "postgres://{APP_ROLE}:{password}@127.0.0.1:{}/{database}",
                self.port
            )
        })
    }

    /// The application role's password, for `grant_app_role`.
    pub fn app_password(&self) -> Option<&str> {
        self.app_password.as_deref()
    }

    /// A connection URL for `database` as the superuser.
    pub fn url(&self, database: &str) -> String {
        format!(
            "postgres://{SUPERUSER}:{}@127.0.0.1:{}/{database}",
            self.password, self.port
        )
    }

    /// Stops the server (fast shutdown: open transactions roll back).
    pub fn stop(&self) -> Result<(), PgError> {
        self.stop_with("fast")
    }

    /// Crashes the server (`pg_ctl stop -m immediate`: every process quits
    /// at once, nothing is flushed; the next start runs crash recovery from
    /// the WAL), as a power loss or a killed postmaster would.
    pub fn crash(&self) -> Result<(), PgError> {
        self.stop_with("immediate")
    }

    fn stop_with(&self, mode: &str) -> Result<(), PgError> {
        let status = self
            .command("pg_ctl")
            .args(["stop", "-w", "-m", mode, "-D"])
            .arg(&self.data_dir)
            .stdout(Stdio::null())
            .status()
            .map_err(|e| PgError::Spawn("pg_ctl".into(), e))?;
        if status.success() {
            Ok(())
        } else {
            Err(PgError::Failed {
                step: "pg_ctl stop",
                detail: format!("exit status {status}"),
            })
        }
    }

    /// Starts the server again on the same port after [`stop`](Self::stop).
    pub fn restart(&self, durability: Durability) -> Result<(), PgError> {
        self.pg_ctl_start(durability)
    }

    /// The port of a server already running on our data directory, if any.
    fn running_port(&self) -> Option<u16> {
        let status = self
            .command("pg_ctl")
            .arg("status")
            .arg("-D")
            .arg(&self.data_dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .ok()?;
        if !status.success() {
            return None;
        }
        // postmaster.pid: pid, data dir, start time, port, ...
        let pid_file = fs::read_to_string(self.data_dir.join("postmaster.pid")).ok()?;
        pid_file.lines().nth(3)?.trim().parse().ok()
    }

    fn pg_ctl_start(&self, durability: Durability) -> Result<(), PgError> {
        let mut options = format!(
            "-p {} -c listen_addresses=127.0.0.1 -c unix_socket_directories= -c max_connections=200",
            self.port
        );
        if durability == Durability::Fast {
            options.push_str(" -c fsync=off -c synchronous_commit=off -c full_page_writes=off");
        } else if self.has_library("pg_stat_statements") {
            // Per-statement costs for `bench` and for operators (the
            // extension is created on demand; loading it costs little).
            options.push_str(" -c shared_preload_libraries=pg_stat_statements");
        }
        let log = self.data_dir.join("server.log");
        let output = self
            .command("pg_ctl")
            .args(["start", "-w", "-t", "60", "-D"])
            .arg(&self.data_dir)
            .arg("-l")
            .arg(&log)
            .arg("-o")
            .arg(options)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .output()
            .map_err(|e| PgError::Spawn("pg_ctl".into(), e))?;
        if output.status.success() {
            return Ok(());
        }
        let tail = fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .rev()
            .take(10)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect::<Vec<_>>()
            .join("\n");
        Err(PgError::Failed {
            step: "pg_ctl start",
            detail: format!(
                "{}{}\nserver log ({}):\n{tail}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr),
                log.display()
            ),
        })
    }

    fn command(&self, program: &str) -> Command {
        command_as(&self.bin_dir.join(program), self.run_as)
    }
}

fn command_as(program: &Path, run_as: Option<RunAs>) -> Command {
    let mut cmd = Command::new(program);
    // The service user must be able to read its working directory.
    cmd.current_dir("/");
    cmd.env_remove("PGDATA").env_remove("PGPORT");
    if let Some(u) = run_as {
        // std drops root's supplementary groups when it switches the uid.
        cmd.uid(u.uid).gid(u.gid);
    }
    cmd
}

fn initdb(
    bin_dir: &Path,
    data_dir: &Path,
    password: &str,
    run_as: Option<RunAs>,
) -> Result<(), PgError> {
    // initdb reads the password from a file the service user can read; it is
    // removed as soon as initdb is done.
    let pwfile = data_dir.with_extension("initpw");
    write_private(&pwfile, password)?;
    if let Some(u) = run_as {
        nix::unistd::chown(&pwfile, Some(u.uid.into()), Some(u.gid.into()))
            .map_err(|e| PgError::io(&pwfile, e.into()))?;
    }
    let output = command_as(&bin_dir.join("initdb"), run_as)
        .arg("-D")
        .arg(data_dir)
        .args([
            "--username",
            SUPERUSER,
            "--auth=scram-sha-256",
            "--encoding=UTF8",
            "--locale=C",
        ])
        .arg(format!("--pwfile={}", pwfile.display()))
        .stdin(Stdio::null())
        .output();
    let _ = fs::remove_file(&pwfile);
    let output = output.map_err(|e| PgError::Spawn("initdb".into(), e))?;
    if !output.status.success() {
        return Err(PgError::Failed {
            step: "initdb",
            detail: format!(
                "{}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            ),
        });
    }
    Ok(())
}

/// Creates `data_dir` (inside `root`) owned by the service user and checks
/// that the service user can reach it.
fn prepare_dir(root: &Path, data_dir: &Path, run_as: Option<RunAs>) -> Result<(), PgError> {
    fs::create_dir_all(data_dir).map_err(|e| PgError::io(data_dir, e))?;
    fs::set_permissions(data_dir, fs::Permissions::from_mode(0o700))
        .map_err(|e| PgError::io(data_dir, e))?;
    if let Some(u) = run_as {
        // The root folder stays ours; the service user only needs to pass through it.
        let mode = fs::metadata(root).map_err(|e| PgError::io(root, e))?.mode();
        fs::set_permissions(root, fs::Permissions::from_mode((mode & 0o7777) | 0o711))
            .map_err(|e| PgError::io(root, e))?;
        nix::unistd::chown(data_dir, Some(u.uid.into()), Some(u.gid.into()))
            .map_err(|e| PgError::io(data_dir, e.into()))?;
        check_reachable(data_dir, u)?;
    }
    Ok(())
}

/// Fails with a fix-it message when the service user cannot enter some folder above `dir`.
fn check_reachable(dir: &Path, u: RunAs) -> Result<(), PgError> {
    for ancestor in dir.ancestors().skip(1) {
        let meta = fs::metadata(ancestor).map_err(|e| PgError::io(ancestor, e))?;
        let mode = meta.mode();
        let can_enter = if meta.uid() == u.uid {
            mode & 0o100 != 0
        } else if meta.gid() == u.gid {
            mode & 0o010 != 0
        } else {
            mode & 0o001 != 0
        };
        if !can_enter {
            return Err(PgError::Unreachable {
                user: SERVICE_USER,
                folder: ancestor.to_path_buf(),
                data_dir: dir.to_path_buf(),
                mode: mode & 0o777,
            });
        }
    }
    Ok(())
}

/// `None` when we are not root; the `postgres` user when we are.
fn service_user() -> Result<Option<RunAs>, PgError> {
    if !nix::unistd::geteuid().is_root() {
        return Ok(None);
    }
    match nix::unistd::User::from_name(SERVICE_USER) {
        Ok(Some(user)) => Ok(Some(RunAs {
            uid: user.uid.as_raw(),
            gid: user.gid.as_raw(),
        })),
        _ => Err(PgError::NoServiceUser(SERVICE_USER)),
    }
}

/// Finds a folder holding `initdb`, `pg_ctl` and `postgres`: first on PATH,
/// then the newest under /usr/lib/postgresql/*/bin.
fn find_bin_dir() -> Result<PathBuf, PgError> {
    let has_all = |dir: &Path| {
        ["initdb", "pg_ctl", "postgres"]
            .iter()
            .all(|b| dir.join(b).is_file())
    };
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            if has_all(&dir) {
                // Resolve symlinked wrappers to the real installation folder.
                let real = dir.join("postgres").canonicalize().ok();
                if let Some(parent) = real.as_deref().and_then(Path::parent) {
                    if has_all(parent) {
                        return Ok(parent.to_path_buf());
                    }
                }
                return Ok(dir);
            }
        }
    }
    let mut versions: Vec<(u32, PathBuf)> = fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let version = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            has_all(&bin).then_some((version, bin))
        })
        .collect();
    versions.sort();
    versions
        .pop()
        .map(|(_, bin)| bin)
        .ok_or(PgError::NoBinaries)
}

fn free_port() -> Result<u16, PgError> {
    let listener =
        TcpListener::bind("127.0.0.1:0").map_err(|e| PgError::io(Path::new("127.0.0.1:0"), e))?;
    Ok(listener
        .local_addr()
        .map_err(|e| PgError::io(Path::new("127.0.0.1:0"), e))?
        .port())
}

fn random_password() -> String {
    use rand::Rng;
    let bytes: [u8; 24] = rand::rng().random();
    hex::encode(bytes)
}

/// Creates `path` with mode 0600, exclusively (`O_EXCL`: a file already
/// there, planted or left over, is an error, never reused) and without
/// following a symlink.
fn write_private(path: &Path, contents: &str) -> Result<(), PgError> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(path)
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::AlreadyExists => PgError::Unsafe {
                path: path.to_path_buf(),
                problem: "already exists, so it was not written by onceflow".into(),
                fix: format!(
                    "remove it if you did not put it there: rm {}",
                    path.display()
                ),
            },
            _ => PgError::io(path, e),
        })?;
    f.write_all(contents.as_bytes())
        .map_err(|e| PgError::io(path, e))
}

/// Reads a secret file onceflow wrote: a plain file (not a symlink), ours,
/// readable by nobody else; anything else is refused.
fn read_private(path: &Path) -> Result<String, PgError> {
    let meta = fs::symlink_metadata(path).map_err(|e| PgError::io(path, e))?;
    let me = nix::unistd::geteuid().as_raw();
    let problem = if !meta.file_type().is_file() {
        Some("is not a plain file (a symlink?)".to_owned())
    } else if meta.uid() != me {
        Some(format!(
            "belongs to uid {}, not to this user ({me})",
            meta.uid()
        ))
    } else if meta.mode() & 0o077 != 0 {
        Some(format!(
            "has mode {:o}; others may read it",
            meta.mode() & 0o777
        ))
    } else {
        None
    };
    if let Some(problem) = problem {
        return Err(PgError::Unsafe {
            path: path.to_path_buf(),
            problem,
            fix: format!(
                "if you did not put it there, remove it and the data folder's pg/ with it; \
                 otherwise `chown $(id -u) {0} && chmod 600 {0}`",
                path.display()
            ),
        });
    }
    Ok(fs::read_to_string(path)
        .map_err(|e| PgError::io(path, e))?
        .trim()
        .to_owned())
}

/// The data folder must belong to this user (or the service user) and be
/// writable by nobody else: otherwise another account could plant the
/// password file, or swap the server's files.
fn check_private_folder(root: &Path, run_as: Option<RunAs>) -> Result<(), PgError> {
    let meta = fs::metadata(root).map_err(|e| PgError::io(root, e))?;
    let me = nix::unistd::geteuid().as_raw();
    let owner_ok = meta.uid() == me || run_as.is_some_and(|u| u.uid == meta.uid());
    let problem = if !owner_ok {
        Some(format!(
            "belongs to uid {}, not to this user ({me})",
            meta.uid()
        ))
    } else if meta.mode() & 0o022 != 0 {
        Some(format!(
            "has mode {:o}: other users may create files in it",
            meta.mode() & 0o7777
        ))
    } else {
        None
    };
    // A folder above that others may write to (without the sticky bit,
    // which keeps them from renaming what is not theirs) lets them swap
    // this one after the check.
    let problem = problem.or_else(|| {
        root.ancestors().skip(1).find_map(|ancestor| {
            let m = fs::metadata(ancestor).ok()?;
            (m.mode() & 0o002 != 0 && m.mode() & 0o1000 == 0).then(|| {
                format!(
                    "lies under {}, which other users may write to (mode {:o}) and so replace it",
                    ancestor.display(),
                    m.mode() & 0o7777
                )
            })
        })
    });
    match problem {
        None => Ok(()),
        Some(problem) => Err(PgError::Unsafe {
            path: root.to_path_buf(),
            problem,
            fix: format!(
                "use a folder of your own (ONCEFLOW_DATA_DIR), or `chown $(id -u) {0} && chmod go-w {0}`",
                root.display()
            ),
        }),
    }
}
