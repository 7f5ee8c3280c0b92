//! The `onceflow` binary: the [`onceflow::App`] with the built-in workflows
//! only. Your own binary does the same with your workflows registered.

fn main() -> std::process::ExitCode {
    match onceflow::App::new().run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
