//! A tiny actix-web server on its own thread and System, so that it keeps
//! answering whatever happens to the engine under test.

use std::collections::VecDeque;
use std::net::{SocketAddr, TcpListener};
use std::sync::Mutex;
use std::time::Duration;

use actix_web::{web, App, HttpServer};

/// What a fake server does with the next request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Behaviour {
    /// Do the work and answer 2xx.
    Ok,
    /// Do nothing and answer this status (with `Retry-After: secs` when given).
    Status(u16, Option<u64>),
    /// Wait this long, then do the work and answer 2xx.
    Slow(Duration),
    /// Do the work, then hold the answer this long (past the client's timeout,
    /// so the client sees an ambiguous failure).
    LoseResponse(Duration),
}

/// A per-request script: the front behaviour is used up by the next request;
/// once empty, `Ok`.
#[derive(Debug, Default)]
pub(crate) struct Script(Mutex<VecDeque<Behaviour>>);

impl Script {
    pub(crate) fn push(&self, b: Behaviour) {
        self.0.lock().expect("script lock").push_back(b);
    }
    pub(crate) fn next(&self) -> Behaviour {
        self.0
            .lock()
            .expect("script lock")
            .pop_front()
            .unwrap_or(Behaviour::Ok)
    }
}

/// The threads the fake servers run on (their System's thread and its
/// workers), so that a benchmark can tell their CPU time from the engine's.
static THREADS: Mutex<Vec<u32>> = Mutex::new(Vec::new());

/// The kernel's id of the calling thread (as in `/proc/self/task/<tid>`).
fn this_thread() -> Option<u32> {
    let link = std::fs::read_link("/proc/thread-self").ok()?;
    link.file_name()?.to_str()?.parse().ok()
}

fn note_this_thread() {
    if let Some(tid) = this_thread() {
        let mut threads = THREADS.lock().expect("threads lock");
        if !threads.contains(&tid) {
            threads.push(tid);
        }
    }
}

/// The thread ids of every fake server started in this process so far (the
/// System's thread and its workers; not their accept threads, whose share
/// is small). A worker notes itself when it starts, just after `spawn`
/// returns. Empty where `/proc` is not mounted.
pub fn threads() -> Vec<u32> {
    THREADS.lock().expect("threads lock").clone()
}

/// Starts `configure` on 127.0.0.1:0 on a thread of its own; returns the address.
pub(crate) fn spawn<F>(name: &str, configure: F) -> SocketAddr
where
    F: Fn(&mut web::ServiceConfig) + Send + Clone + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    let addr = listener.local_addr().expect("local addr");
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(move || {
            note_this_thread();
            actix_web::rt::System::new().block_on(async move {
                // The factory runs once on each worker's thread.
                let server = HttpServer::new(move || {
                    note_this_thread();
                    App::new().configure(configure.clone())
                })
                .workers(2)
                .disable_signals()
                .shutdown_timeout(0)
                // HTTP/1.1, or HTTP/2 for a client that starts with its preface (h2c).
                .listen_auto_h2c(listener)
                .expect("listen")
                .run();
                ready_tx.send(()).expect("ready");
                let _ = server.await;
            })
        })
        .expect("spawn fake server thread");
    ready_rx.recv().expect("fake server started");
    addr
}
