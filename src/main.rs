//! The `onceflow` binary: the [`onceflow::App`] with the built-in workflows
//! only. Your own binary does the same with your workflows registered.

/// mimalloc: under load glibc's malloc and free took about a third of the
/// process's CPU (many small, short-lived JSON values and HTTP buffers
/// across threads); see the README's benchmark notes.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    match onceflow::App::new().run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
