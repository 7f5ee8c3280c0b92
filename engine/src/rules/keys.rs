//! Idempotency keys, built in one place. Every key is a function of the job
//! (its id and incarnation) and the step or event name: identical on every
//! attempt, process and node. A per-attempt UUID, a timestamp or a queue
//! message id here would be a bug.
//!
//! The first incarnation of an id keys its side effects `job:{id}:…`. An id
//! submitted again after its job was purged (retention) is a new incarnation
//! `n ≥ 2`, keyed `job:{id}#{n}:…`: ids cannot contain `#`, so no key of one
//! incarnation is ever a key of another.

/// The event name of the completion webhook.
pub const COMPLETED_EVENT: &str = "job.completed";

/// The prefix every key of one incarnation of a job shares: `job:{id}` for
/// the first, `job:{id}#{n}` after that.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobKey(String);

impl JobKey {
    /// The prefix of incarnation `incarnation` of job `job_id` (1 for the first).
    pub fn new(job_id: &str, incarnation: i32) -> Self {
        if incarnation <= 1 {
            JobKey(format!("job:{job_id}"))
        } else {
            JobKey(format!("job:{job_id}#{incarnation}"))
        }
    }

    /// The prefix itself (`job:{id}` or `job:{id}#{n}`).
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// The key of a model call made by step `step` (`job:{id}:{step}`).
pub fn model_call(job: &JobKey, step: &str) -> String {
    format!("{}:{step}", job.0)
}

/// The key of the completion webhook (`job:{id}:completed`), sent as both
/// `Idempotency-Key` and `webhook-id`.
pub fn completed(job: &JobKey) -> String {
    format!("{}:completed", job.0)
}

/// The event name of the failure webhooks.
pub const DEAD_EVENT: &str = "job.dead";
/// The event name of the webhook sent when a job is cancelled.
pub const CANCELLED_EVENT: &str = "job.cancelled";

/// The key of a failure event (`job:{id}:dead`, `job:{id}:cancelled`).
pub fn failure(job: &JobKey, what: &str) -> String {
    format!("{}:{what}", job.0)
}

/// The key of the model call of agent turn `turn` (`job:{id}:turn:{n}`).
pub fn turn(job: &JobKey, turn: u32) -> String {
    format!("{}:turn:{turn}", job.0)
}

/// The key a tool passes on with its own side effect: the call's position in
/// the conversation (`job:{id}:tool:{turn}:{index}`), not the provider's
/// tool-call id, which some providers regenerate or reuse.
pub fn tool(job: &JobKey, turn: i32, index: i32) -> String {
    format!("{}:tool:{turn}:{index}", job.0)
}

/// The key of general step `name` (`job:{id}:step:{name}`).
pub fn step(job: &JobKey, name: &str) -> String {
    format!("{}:step:{name}", job.0)
}

/// The key a body's own retryable failure `name` is counted under
/// (`job:{id}:retry:{name}`): its retry budget (`Context::retry`).
pub fn retry(job: &JobKey, name: &str) -> String {
    format!("{}:retry:{name}", job.0)
}

/// The key of timer `name` (`job:{id}:sleep:{name}`).
pub fn sleep(job: &JobKey, name: &str) -> String {
    format!("{}:sleep:{name}", job.0)
}

/// The key of the `nth` wait (1-based) for signal `name` in a run of the
/// body: `job:{id}:signal:{name}` for the first, `…:{name}#{n}` after it.
pub fn signal(job: &JobKey, name: &str, nth: u32) -> String {
    match nth {
        0 | 1 => format!("{}:signal:{name}", job.0),
        n => format!("{}:signal:{name}#{n}", job.0),
    }
}

/// The key, and the outbox event, of the `job.waiting` event the `nth`
/// approval wait for signal `name` sends: `job:{id}:waiting:{name}` and
/// `job.waiting:{name}` for the first, `…:{name}#{n}` after it, like the
/// wait's own key (the outbox holds one row per job and event).
pub fn waiting(job: &JobKey, name: &str, nth: u32) -> (String, String) {
    let name = match nth {
        0 | 1 => name.to_owned(),
        n => format!("{name}#{n}"),
    };
    (
        format!("{}:waiting:{name}", job.0),
        format!("job.waiting:{name}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_functions_of_the_job_and_its_incarnation() {
        let first = JobKey::new("a-1", 1);
        assert_eq!(model_call(&first, "generate"), "job:a-1:generate");
        assert_eq!(completed(&first), "job:a-1:completed");
        assert_eq!(completed(&first), completed(&JobKey::new("a-1", 1)));
        assert_eq!(tool(&first, 2, 0), "job:a-1:tool:2:0");
        assert_eq!(step(&first, "s"), "job:a-1:step:s");
        assert_eq!(sleep(&first, "s"), "job:a-1:sleep:s");
        assert_eq!(signal(&first, "go", 1), "job:a-1:signal:go");
        assert_eq!(signal(&first, "go", 2), "job:a-1:signal:go#2");
        assert_eq!(
            waiting(&first, "approval:c", 1),
            (
                "job:a-1:waiting:approval:c".to_owned(),
                "job.waiting:approval:c".to_owned()
            )
        );
        assert_eq!(
            waiting(&JobKey::new("a-1", 2), "approval:c", 2),
            (
                "job:a-1#2:waiting:approval:c#2".to_owned(),
                "job.waiting:approval:c#2".to_owned()
            )
        );
        let second = JobKey::new("a-1", 2);
        assert_eq!(completed(&second), "job:a-1#2:completed");
        assert_eq!(turn(&second, 3), "job:a-1#2:turn:3");
        assert_ne!(completed(&first), completed(&second));
    }
}
