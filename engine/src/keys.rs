//! Idempotency keys, built in one place. Every key is a function of the job id
//! and the step or event name: identical on every attempt, process and node.
//! A per-attempt UUID, a timestamp or a queue message id here would be a bug.

/// The event name of the completion webhook.
pub const COMPLETED_EVENT: &str = "job.completed";

/// The key of a model call made by step `step` of job `job_id` (`job:{id}:{step}`).
pub fn model_call(job_id: &str, step: &str) -> String {
    format!("job:{job_id}:{step}")
}

/// The key of the completion webhook (`job:{id}:completed`), sent as both
/// `Idempotency-Key` and `webhook-id`.
pub fn completed(job_id: &str) -> String {
    format!("job:{job_id}:completed")
}

/// The key of the model call of agent turn `turn` (`job:{id}:turn:{n}`).
pub fn turn(job_id: &str, turn: u32) -> String {
    format!("job:{job_id}:turn:{turn}")
}

/// The key a tool passes on with its own side effect: the call's position in
/// the conversation (`job:{id}:tool:{turn}:{index}`), not the provider's
/// tool-call id, which some providers regenerate or reuse.
pub fn tool(job_id: &str, turn: i32, index: i32) -> String {
    format!("job:{job_id}:tool:{turn}:{index}")
}

/// The key of general step `name` (`job:{id}:step:{name}`).
pub fn step(job_id: &str, name: &str) -> String {
    format!("job:{job_id}:step:{name}")
}

#[cfg(test)]
mod tests {
    #[test]
    fn keys_are_functions_of_the_job() {
        assert_eq!(super::model_call("a-1", "generate"), "job:a-1:generate");
        assert_eq!(super::completed("a-1"), "job:a-1:completed");
        assert_eq!(super::completed("a-1"), super::completed("a-1"));
    }
}
