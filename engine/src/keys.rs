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

#[cfg(test)]
mod tests {
    #[test]
    fn keys_are_functions_of_the_job() {
        assert_eq!(super::model_call("a-1", "generate"), "job:a-1:generate");
        assert_eq!(super::completed("a-1"), "job:a-1:completed");
        assert_eq!(super::completed("a-1"), super::completed("a-1"));
    }
}
