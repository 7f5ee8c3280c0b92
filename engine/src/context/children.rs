//! `ctx.spawn` and `ctx.join`: child jobs, fan-out and fan-in.
//!
//! A child is a job of any registered workflow, started by this job's body
//! under a name: its id is `{parent id}:child:{name}` (`{parent
//! id}:child.{n}:{name}` in the parent's `n`-th incarnation), so however often the
//! body runs (crashes, takeovers, replays) the name makes one child, which
//! intake's idempotency finds again. It belongs to the parent's token,
//! continues the parent's trace, and sends no webhook of its own unless
//! given a `webhook_url`. `ctx.join` waits for children as a durable wait
//! (kind `children`): the parent holds no actor or lease meanwhile, and
//! each child's outcome — its result, or why it died or was cancelled — is
//! journaled once for every replay (see [`crate::store::children`]).

use std::time::Duration;

use serde_json::Value;

use super::wait::valid_wait_name;
use super::Context;
use crate::error::{InvalidInput, StepError};
use crate::faults::FailPoint;
use crate::request::{NewJob, Schedule};
use crate::rules::wait_machine::WaitKind;
use crate::store::children::Spawned;
use crate::store::waits::WaitStep;

/// What the node checks before a child starts (its workflow registered,
/// its input valid, its webhook URL allowed); the node's registry lives
/// above this layer, so it is handed in.
pub(crate) trait ChildRules: Send + Sync + std::fmt::Debug {
    /// The version a new job of `workflow` starts on, and whether its
    /// failures send events; or why the child is refused.
    fn check(
        &self,
        workflow: &str,
        input: &Value,
        webhook_url: Option<&str>,
    ) -> Result<(i32, bool), InvalidInput>;
}

/// A child job this job started.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Child {
    /// Its job id: `{parent id}:child:{name}`.
    pub id: String,
    /// The name it was started under.
    pub name: String,
}

/// A child that did not end `acked`: dead, cancelled, still running when
/// the join timed out, or gone (purged).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("child job {id} ended {state}{}", reason.as_ref().map(|r| format!(": {r}")).unwrap_or_default())]
pub struct ChildFailed {
    /// The child's job id.
    pub id: String,
    /// `dead`, `cancelled`, `missing`, or the state it was in at the timeout.
    pub state: String,
    /// Why it died, when it did.
    pub reason: Option<String>,
    /// Its last error, as stored with it.
    pub error: Option<Value>,
}

impl From<ChildFailed> for StepError {
    /// The parent dies too (`child_failed`), naming the child.
    fn from(f: ChildFailed) -> Self {
        StepError::permanent("child_failed", f.to_string(), f.to_string())
    }
}

/// A child's id: `{parent id}:child:{name}` for the parent's first
/// incarnation, `{parent id}:child.{n}:{name}` for its `n`-th (an id
/// submitted again after a purge): a new life of the parent makes children
/// of its own and never finds the last one's.
pub fn child_id(parent: &str, incarnation: i32, name: &str) -> String {
    if incarnation <= 1 {
        format!("{parent}:child:{name}")
    } else {
        format!("{parent}:child.{incarnation}:{name}")
    }
}

impl Context {
    /// Starts child job `name` of `workflow` with `input` (see the module's
    /// documentation): once per name, whatever the crashes. It sends no
    /// webhook of its own.
    pub async fn spawn(
        &mut self,
        name: &str,
        workflow: &str,
        input: &Value,
    ) -> Result<Child, StepError> {
        self.spawn_child(name, workflow, input, None).await
    }

    /// [`spawn`](Self::spawn), with the child's own completion webhook to
    /// `webhook_url`.
    pub async fn spawn_with_webhook(
        &mut self,
        name: &str,
        workflow: &str,
        input: &Value,
        webhook_url: &str,
    ) -> Result<Child, StepError> {
        self.spawn_child(name, workflow, input, Some(webhook_url))
            .await
    }

    async fn spawn_child(
        &mut self,
        name: &str,
        workflow: &str,
        input: &Value,
        webhook_url: Option<&str>,
    ) -> Result<Child, StepError> {
        let refused = |e: InvalidInput| {
            StepError::permanent(
                "invalid_child",
                format!("child {name:?} of workflow {workflow:?} was refused"),
                e.to_string(),
            )
        };
        if !valid_wait_name(name) {
            return Err(refused(InvalidInput::new(
                "name",
                "must be 1-200 characters of A-Z a-z 0-9 _ . : -",
            )));
        }
        let id = child_id(self.job_id(), self.fence.incarnation, name);
        if id.len() > crate::request::MAX_JOB_ID_LEN {
            return Err(refused(InvalidInput::new(
                "name",
                format!(
                    "the child's id {{parent}}:child:{{name}} is longer than {} characters",
                    crate::request::MAX_JOB_ID_LEN
                ),
            )));
        }
        let (version, notify_failures) = match self.children.check(workflow, input, webhook_url) {
            Ok(checked) => checked,
            // A replay on a node that lacks the child's workflow (or its
            // tools) finds the child it made before it judges it again.
            Err(e) => {
                if self
                    .store
                    .waits()
                    .is_child_of(&id, &self.fence, workflow, input)
                    .await?
                {
                    return Ok(Child {
                        id,
                        name: name.to_owned(),
                    });
                }
                return Err(refused(e));
            }
        };
        self.not_draining()?;
        let job = NewJob {
            tags: Default::default(),
            id: id.clone(),
            workflow: workflow.to_owned(),
            workflow_version: version,
            input: input.clone(),
            webhook_url: webhook_url.unwrap_or_default().to_owned(),
            schedule: Schedule {
                priority: self.priority,
                ..Schedule::default()
            },
        };
        // The child's trace continues from this span, a child of the attempt.
        let span = self.scope.step(
            onceflow_observability::names::SPAN_SPAWN,
            opentelemetry::trace::SpanKind::Producer,
            vec![
                opentelemetry::KeyValue::new("onceflow.child.id", id.clone()),
                opentelemetry::KeyValue::new(
                    onceflow_observability::names::WORKFLOW_NAME,
                    workflow.to_owned(),
                ),
            ],
        );
        // The row as every source makes it: in the child's trace, of the
        // parent's token, a child of this life of the parent; bounded by
        // its parent's place in the backlog, not a place of its own.
        let row = crate::store::Submission::new(&job)
            .traced(span.trace())
            .owned(self.owner_token, notify_failures)
            .child_of(self.job_id())
            .row();
        self.faults
            .hit(self.job_id(), FailPoint::BeforeCommit("spawn"))
            .await?;
        match Box::pin(self.store.waits().spawn_child(&self.fence, row)).await? {
            Spawned::Created => span.count_intake(workflow, "created"),
            Spawned::Existing => span.count_intake(workflow, "existing"),
            Spawned::LeaseLost => return Err(StepError::LeaseLost),
            Spawned::Conflict => {
                return Err(StepError::permanent(
                    "child_conflict",
                    format!("child job {id} exists with another request or parent"),
                    format!(
                    "the body started child {name:?} with another workflow or input than before, \
                         or job id {id} belongs to another job; nothing was started"
                ),
                ))
            }
        }
        span.end("spawned");
        self.faults
            .hit(self.job_id(), FailPoint::AfterCommit("spawn"))
            .await?;
        Ok(Child {
            id,
            name: name.to_owned(),
        })
    }

    /// Waits for `children` to finish, for at most `timeout`: one result
    /// per child, in order, the child's output when it ended `acked`, or a
    /// [`ChildFailed`] the body may handle (or pass on with `?`, which
    /// fails this job too). The parent holds no actor or lease meanwhile.
    /// The `n`-th join of a run is journaled under `job:{id}:join:{n}`.
    /// Pass the error on with `?`.
    pub async fn join(
        &mut self,
        children: &[Child],
        timeout: Duration,
    ) -> Result<Vec<Result<Value, ChildFailed>>, StepError> {
        self.joins += 1;
        let name = format!("join:{}", self.joins);
        let key = format!("{}:{name}", self.fence.key().as_str());
        self.follow_journal(&name, &key, false).await?;
        let outcome = match self.journaled_wait(&key, WaitKind::Children)? {
            Some(outcome) => outcome,
            None => {
                self.not_draining()?;
                let ids: Vec<String> = children.iter().map(|c| c.id.clone()).collect();
                let timeout_ms = i64::try_from(timeout.as_millis()).unwrap_or(i64::MAX / 2);
                self.faults
                    .hit(self.job_id(), FailPoint::BeforeCommit("join"))
                    .await?;
                let step = Box::pin(self.store.waits().join_children(
                    &self.fence,
                    &key,
                    &name,
                    &ids,
                    timeout_ms,
                ))
                .await?;
                if step != WaitStep::LeaseLost {
                    self.faults
                        .hit(self.job_id(), FailPoint::AfterCommit("join"))
                        .await?;
                }
                match step {
                    WaitStep::Done(outcome) => outcome,
                    WaitStep::Waiting { until, due } => {
                        return Err(StepError::Waiting {
                            kind: "children",
                            name,
                            until,
                            due,
                        });
                    }
                    WaitStep::LeaseLost => return Err(StepError::LeaseLost),
                }
            }
        };
        let Some(listed) = outcome.into_children() else {
            return Err(StepError::permanent(
                "invalid_journal",
                format!("the journaled outcome of {key:?} is not a join's"),
                String::new(),
            ));
        };
        Ok(listed
            .into_iter()
            .map(|c| {
                if c.state == "acked" {
                    Ok(c.result.unwrap_or(Value::Null))
                } else {
                    Err(ChildFailed {
                        id: c.id,
                        state: c.state,
                        reason: c.dead_reason,
                        error: c.error,
                    })
                }
            })
            .collect())
    }
}
