//! A workflow that asks a person before it acts: it waits for the signal
//! `approve` (holding nothing while it waits), then makes the refund once.

use std::time::Duration;

use onceflow::{Context, StepError, Workflow};
use serde::{Deserialize, Serialize};
use serde_json::json;

/// Refunds an order once a person approves.
pub struct Refund;

#[derive(Serialize, Deserialize)]
pub struct RefundRequest {
    pub order: String,
    pub amount_cents: u64,
    /// Where the refund is made (your payment service).
    pub refund_url: String,
}

#[derive(Serialize, Deserialize)]
pub struct RefundOutcome {
    pub refunded: bool,
}

#[derive(Deserialize)]
pub struct Decision {
    pub approved: bool,
}

impl Workflow for Refund {
    const NAME: &'static str = "refund";
    type Input = RefundRequest;
    type Output = RefundOutcome;

    async fn run(
        &self,
        ctx: &mut Context,
        refund: RefundRequest,
    ) -> Result<RefundOutcome, StepError> {
        // `onceflow signal JOB approve --id … --payload '{"approved": true}'`.
        // Unanswered within a day: no refund.
        let decision: Option<Decision> = ctx
            .wait_for_signal("approve", Duration::from_secs(86_400))
            .await?;
        if !decision.is_some_and(|d| d.approved) {
            return Ok(RefundOutcome { refunded: false });
        }
        // Once: journaled under `job:{id}:step:refund`; its key goes with the request.
        let body = json!({ "order": refund.order, "amount_cents": refund.amount_cents });
        ctx.step("refund", |step| async move {
            step.post_json(&refund.refund_url, &body).await
        })
        .await?;
        Ok(RefundOutcome { refunded: true })
    }
}
