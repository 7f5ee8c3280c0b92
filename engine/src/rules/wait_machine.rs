//! The wait machine, pure: what a job waits for ([`WaitKind`], and
//! [`Waiting`], the one type the `jobs.waiting` column is written from and
//! read back as), how a journaled wait ends ([`WaitOutcome`], journaled as
//! the same JSON it always was), and the one function that decides it
//! from what the store read and the database's clock ([`decide`]) — the
//! journaled outcome first, always. No I/O: the store runs the statements
//! around it (`store::waits`, `store::children`), the context reads the
//! outcome back typed (`context::wait`, `context::children`), and table
//! tests cover every kind × state × timing, and canned journals replayed,
//! without a database.
//!
//! On disk, in `waits.outcome`:
//!
//! | outcome | JSON |
//! |---|---|
//! | the timer fired | `{"slept": true}` |
//! | a signal was taken | `{"signal": {"id": "<signal id>", "payload": <JSON>}}` |
//! | no signal before the due time | `{"timeout": true}` |
//! | a join ended (every child over, or its timeout) | `{"children": [{"id", "state", "finished", "result", "error", "dead_reason"}, …]}` |
//!
//! In `jobs.waiting` (and `GET /v1/jobs/{id}`'s `waiting`), by `kind`:
//! `sleep`, `signal`, `approval` (`name`, `until`; an approval also its
//! `tool`), `children` (`name`, `until`, `children`, `pending`), `budget`
//! (`until`, `reserved`?), `concurrency` (`key`), `throttle` (`key`,
//! `until`), `provider` (`key`, `queued_at`). Rust writes the first five
//! from [`Waiting`]; a provider's wait is written, and a key's computed,
//! in SQL where one statement decides them (`store::slots`,
//! `store::jobs`), in the same shape: the test kit reads every job's
//! `waiting` back as [`Waiting`] and fails on one that does not parse.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// What a job waits for: a journaled wait (sleep, signal, approval, a
/// join of children), or a turn it is not given yet (a budget, a key's
/// concurrency or throttle, a provider's slot).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitKind {
    /// A timer (`ctx.sleep`, `ctx.sleep_until`).
    Sleep,
    /// A signal of a name, with a timeout (`ctx.wait_for_signal`).
    Signal,
    /// A person's decision on a tool call: a signal named `approval:{tool_call_id}`.
    Approval,
    /// Its children, joined (`ctx.join`), with a timeout.
    Children,
    /// Its token's daily model-token budget, spent or reserved.
    Budget,
    /// A slot of its concurrency key.
    Concurrency,
    /// A start of its key's throttle.
    Throttle,
    /// A slot of a provider limit.
    Provider,
}

impl WaitKind {
    /// Every kind, as `GET /v1/jobs?waiting=` takes them.
    pub const ALL: [WaitKind; 8] = [
        WaitKind::Sleep,
        WaitKind::Signal,
        WaitKind::Approval,
        WaitKind::Children,
        WaitKind::Budget,
        WaitKind::Concurrency,
        WaitKind::Throttle,
        WaitKind::Provider,
    ];

    /// The name stored and shown (`"waiting": {"kind": …}`).
    pub fn as_str(self) -> &'static str {
        match self {
            WaitKind::Sleep => "sleep",
            WaitKind::Signal => "signal",
            WaitKind::Approval => "approval",
            WaitKind::Children => "children",
            WaitKind::Budget => "budget",
            WaitKind::Concurrency => "concurrency",
            WaitKind::Throttle => "throttle",
            WaitKind::Provider => "provider",
        }
    }

    /// Whether a signal of the wait's name ends it.
    pub fn takes_signals(self) -> bool {
        matches!(self, WaitKind::Signal | WaitKind::Approval)
    }

    /// Whether the wait is journaled and ends with a [`WaitOutcome`] (the
    /// others are turns the job is given, and leave nothing in its journal).
    pub fn is_journaled(self) -> bool {
        matches!(
            self,
            WaitKind::Sleep | WaitKind::Signal | WaitKind::Approval | WaitKind::Children
        )
    }
}

// As `jobs.waiting` holds it and the API shows it: written from this
// type, read back as it.
/// What a job waits for, by `kind`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Waiting {
    /// A timer.
    Sleep {
        /// The timer's name.
        name: String,
        /// When it fires.
        until: DateTime<Utc>,
    },
    /// A signal of `name`, until its timeout.
    Signal {
        /// The signal's name.
        name: String,
        /// When the wait times out (send `until` with the signal to decide this wait only).
        until: DateTime<Utc>,
    },
    /// A person's decision on a tool call (the signal `approval:{tool_call_id}`).
    Approval {
        /// `approval:{tool_call_id}`.
        name: String,
        /// When the wait times out.
        until: DateTime<Utc>,
        /// The tool call waiting for the decision.
        tool: ApprovalCall,
    },
    /// Its children, joined.
    Children {
        /// The join's name (`join:{n}`).
        name: String,
        /// When the join times out.
        until: DateTime<Utc>,
        /// Children not over yet (at most 100 shown).
        children: Vec<String>,
        /// How many children are not over.
        pending: usize,
    },
    /// Its token's daily model-token budget.
    Budget {
        /// When it is looked at again (the next UTC day, or a reservation's lapse).
        until: DateTime<Utc>,
        /// Held by other calls' reservations, not by spend.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        reserved: bool,
    },
    /// Every slot of its concurrency key is held.
    Concurrency {
        /// The key.
        key: String,
    },
    /// Its key's starts for the period are used up.
    Throttle {
        /// The key.
        key: String,
        /// When a start frees.
        until: DateTime<Utc>,
    },
    /// Every slot of a provider limit is held.
    Provider {
        /// The limit's key (`provider:model`).
        key: String,
        /// When it first waited for this limit (its place in the line).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        queued_at: Option<DateTime<Utc>>,
    },
}

/// The tool call an approval is asked for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ApprovalCall {
    /// The model's id for the call.
    pub tool_call_id: String,
    /// The tool.
    pub name: String,
    /// Its arguments, as the model gave them.
    #[schema(value_type = Object)]
    pub arguments: Value,
}

impl Waiting {
    /// Its kind.
    pub fn kind(&self) -> WaitKind {
        match self {
            Waiting::Sleep { .. } => WaitKind::Sleep,
            Waiting::Signal { .. } => WaitKind::Signal,
            Waiting::Approval { .. } => WaitKind::Approval,
            Waiting::Children { .. } => WaitKind::Children,
            Waiting::Budget { .. } => WaitKind::Budget,
            Waiting::Concurrency { .. } => WaitKind::Concurrency,
            Waiting::Throttle { .. } => WaitKind::Throttle,
            Waiting::Provider { .. } => WaitKind::Provider,
        }
    }

    /// As the column holds it.
    pub fn to_json(&self) -> Value {
        serde_json::to_value(self).expect("a wait serialises")
    }

    /// Read back from the column; `None` for a value no kind here writes.
    pub fn from_json(value: &Value) -> Option<Self> {
        serde_json::from_value(value.clone()).ok()
    }
}

/// A signal a wait took: its sender's id and what it carries.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TakenSignal {
    /// The sender's id for the signal.
    pub id: String,
    /// What it carries.
    #[serde(default)]
    pub payload: Value,
}

/// One child, as a join's outcome holds it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChildOutcome {
    /// The child's id.
    pub id: String,
    /// Its state (`missing` when no such job exists).
    pub state: String,
    /// Whether it is over (absent for a missing child).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished: Option<bool>,
    /// Its result, when it was acked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
    /// Its last error, when it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<Value>,
    /// Why it died, when it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dead_reason: Option<String>,
}

/// How a wait ended, as journaled (see the module's table).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum WaitOutcome {
    /// The timer fired (always `true`).
    Slept(bool),
    /// A signal was taken.
    Signal(TakenSignal),
    /// The due time passed with no signal (always `true`).
    Timeout(bool),
    /// A join ended: every child, in the order joined, as it stood.
    Children(Vec<ChildOutcome>),
}

impl WaitOutcome {
    /// The outcome as journaled.
    pub fn to_json(&self) -> Value {
        serde_json::to_value(self).expect("a wait outcome serialises")
    }

    /// An outcome read back from the journal; `None` for one this machine
    /// never writes.
    pub fn from_json(value: &Value) -> Option<Self> {
        serde_json::from_value(value.clone()).ok()
    }

    /// The signal, when a signal ended the wait.
    pub fn into_signal(self) -> Option<TakenSignal> {
        match self {
            WaitOutcome::Signal(s) => Some(s),
            _ => None,
        }
    }

    /// The children, when a join ended.
    pub fn into_children(self) -> Option<Vec<ChildOutcome>> {
        match self {
            WaitOutcome::Children(c) => Some(c),
            _ => None,
        }
    }
}

/// What the store read, in the transaction that decides a wait.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Seen {
    /// The oldest signal of the wait's name it may take (`None` for a
    /// timer or a join, or when none was sent).
    pub signal: Option<TakenSignal>,
    /// A join's children as they stand, and whether every one is over.
    pub children: Option<(Vec<ChildOutcome>, bool)>,
    /// Whether the due time has passed, by the database's clock.
    pub due: bool,
}

/// What the machine decided.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// The wait is over: journal this outcome (or return it, when it was
    /// journaled before) and go on.
    Over(WaitOutcome),
    /// Not over: release the job until its due time (or a signal).
    Wait,
}

/// Decides a journaled wait of `kind`: the outcome journaled before
/// first (a replay returns it, whatever else changed — the one place this
/// rule is coded; the store and the context both ask here), else from what
/// the store `seen` in one transaction. A signal wins over a timeout that
/// fell due at the same moment (it was sent before the job looked); a join
/// is over when every child is, or at its due time with the children as
/// they stand. A turn (budget, key, provider) is no journaled wait: it
/// waits here, and is decided where its turn is given.
pub fn decide(kind: WaitKind, journaled: Option<WaitOutcome>, seen: Seen) -> Decision {
    if let Some(outcome) = journaled {
        return Decision::Over(outcome);
    }
    let Seen {
        signal,
        children,
        due,
    } = seen;
    match kind {
        WaitKind::Sleep if due => Decision::Over(WaitOutcome::Slept(true)),
        WaitKind::Signal | WaitKind::Approval => match (signal, due) {
            (Some(signal), _) => Decision::Over(WaitOutcome::Signal(signal)),
            (None, true) => Decision::Over(WaitOutcome::Timeout(true)),
            (None, false) => Decision::Wait,
        },
        WaitKind::Children => match children {
            Some((children, all_over)) if all_over || due => {
                Decision::Over(WaitOutcome::Children(children))
            }
            _ => Decision::Wait,
        },
        WaitKind::Sleep
        | WaitKind::Budget
        | WaitKind::Concurrency
        | WaitKind::Throttle
        | WaitKind::Provider => Decision::Wait,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn signal() -> TakenSignal {
        TakenSignal {
            id: "s-1".into(),
            payload: json!({ "approved": true }),
        }
    }

    fn child(id: &str, state: &str) -> ChildOutcome {
        ChildOutcome {
            id: id.into(),
            state: state.into(),
            finished: Some(state == "acked" || state == "dead"),
            result: (state == "acked").then(|| json!({ "n": 1 })),
            error: None,
            dead_reason: None,
        }
    }

    /// A join's children as they stand, and whether every one is over.
    type Standing = Option<(Vec<ChildOutcome>, bool)>;

    /// `WaitKind::ALL` holds every kind, each once: a new kind fails to
    /// compile here until it is placed (and so in every table below).
    #[test]
    fn all_is_every_kind() {
        let place = |kind: WaitKind| match kind {
            WaitKind::Sleep => 0,
            WaitKind::Signal => 1,
            WaitKind::Approval => 2,
            WaitKind::Children => 3,
            WaitKind::Budget => 4,
            WaitKind::Concurrency => 5,
            WaitKind::Throttle => 6,
            WaitKind::Provider => 7,
        };
        let places: Vec<usize> = WaitKind::ALL.iter().map(|k| place(*k)).collect();
        assert_eq!(places, (0..8).collect::<Vec<_>>());
    }

    /// Every kind × journaled or not × a signal or not × children over or
    /// not × due or not.
    #[test]
    fn the_table_of_every_kind_state_and_timing() {
        use Decision::{Over, Wait};
        use WaitKind::*;
        let slept = WaitOutcome::Slept(true);
        let timeout = WaitOutcome::Timeout(true);
        let took = WaitOutcome::Signal(signal());
        let before = WaitOutcome::Signal(TakenSignal {
            id: "earlier".into(),
            payload: json!(1),
        });
        let done = vec![child("a", "acked"), child("b", "dead")];
        let partly = vec![child("a", "acked"), child("b", "received")];
        let joined = WaitOutcome::Children(done.clone());
        let timed_out = WaitOutcome::Children(partly.clone());
        let over = Some((done.clone(), true));
        let running = Some((partly.clone(), false));
        #[rustfmt::skip]
        let table: Vec<(WaitKind, Option<WaitOutcome>, bool, Standing, bool, Decision)> = vec![
            // kind       journaled              signal children         due    decision
            (Sleep,       None,                  false, None,            false, Wait),
            (Sleep,       None,                  false, None,            true,  Over(slept.clone())),
            (Sleep,       None,                  true,  None,            false, Wait), // a timer takes no signal
            (Sleep,       None,                  true,  None,            true,  Over(slept.clone())),
            (Sleep,       Some(slept.clone()),   false, None,            false, Over(slept.clone())),
            (Sleep,       Some(slept.clone()),   true,  None,            true,  Over(slept.clone())),
            (Signal,      None,                  false, None,            false, Wait),
            (Signal,      None,                  false, None,            true,  Over(timeout.clone())),
            (Signal,      None,                  true,  None,            false, Over(took.clone())),
            (Signal,      None,                  true,  None,            true,  Over(took.clone())), // the signal wins
            (Signal,      Some(timeout.clone()), true,  None,            false, Over(timeout.clone())), // a replay keeps it
            (Signal,      Some(before.clone()),  true,  None,            true,  Over(before.clone())),
            (Approval,    None,                  false, None,            false, Wait),
            (Approval,    None,                  false, None,            true,  Over(timeout.clone())),
            (Approval,    None,                  true,  None,            false, Over(took.clone())),
            (Approval,    None,                  true,  None,            true,  Over(took.clone())),
            (Approval,    Some(took.clone()),    false, None,            true,  Over(took.clone())),
            (Children,    None,                  false, running.clone(), false, Wait),
            (Children,    None,                  false, running.clone(), true,  Over(timed_out.clone())), // the timeout, as they stand
            (Children,    None,                  false, over.clone(),    false, Over(joined.clone())),
            (Children,    None,                  true,  over.clone(),    true,  Over(joined.clone())), // a join takes no signal
            (Children,    Some(timed_out.clone()), false, over.clone(),  true,  Over(timed_out.clone())), // a replay keeps it
            (Children,    None,                  false, None,            false, Wait),
            (Budget,      None,                  true,  over.clone(),    true,  Wait), // a turn is decided where it is given
            (Concurrency, None,                  true,  None,            true,  Wait),
            (Throttle,    None,                  false, None,            true,  Wait),
            (Provider,    None,                  false, None,            true,  Wait),
            (Provider,    Some(slept.clone()),   false, None,            false, Over(slept.clone())),
        ];
        for kind in WaitKind::ALL {
            assert!(
                table.iter().any(|row| row.0 == kind),
                "{kind:?} is in the table"
            );
        }
        for (kind, journaled, has_signal, children, due, expected) in table {
            let seen = Seen {
                signal: has_signal.then(signal),
                children: children.clone(),
                due,
            };
            let got = decide(kind, journaled.clone(), seen);
            assert_eq!(
                got, expected,
                "{kind:?} journaled={journaled:?} signal={has_signal} children={children:?} due={due}"
            );
        }
    }

    /// The outcomes are the JSON journals have always held, both ways.
    #[test]
    fn outcomes_are_the_journals_json() {
        for (outcome, json) in [
            (WaitOutcome::Slept(true), json!({ "slept": true })),
            (WaitOutcome::Timeout(true), json!({ "timeout": true })),
            (
                WaitOutcome::Signal(signal()),
                json!({ "signal": { "id": "s-1", "payload": { "approved": true } } }),
            ),
            (
                WaitOutcome::Children(vec![child("p:child:a", "acked")]),
                json!({ "children": [{ "id": "p:child:a", "state": "acked", "finished": true, "result": { "n": 1 } }] }),
            ),
        ] {
            assert_eq!(outcome.to_json(), json);
            assert_eq!(WaitOutcome::from_json(&json), Some(outcome));
        }
        assert_eq!(WaitOutcome::from_json(&json!({ "woke": true })), None);
    }

    /// Journals as earlier versions wrote them (a join wrote every field,
    /// `null` included; a missing child only its id and state), replayed
    /// against a workflow changed since — another wait kind at the same
    /// key, other signals sent, other children's states, another clock —
    /// decide as they were recorded, in the manner of a canned history.
    #[test]
    fn canned_journals_replay_to_the_recorded_decisions() {
        let canned = [
            (WaitKind::Sleep, r#"{"slept": true}"#),
            (WaitKind::Signal, r#"{"timeout": true}"#),
            (
                WaitKind::Approval,
                r#"{"signal": {"id": "ops-7", "payload": {"approved": false, "note": "no"}}}"#,
            ),
            (
                WaitKind::Children,
                r#"{"children": [
                    {"id": "o:child:a", "state": "acked", "finished": true, "result": {"n": 2}, "error": null, "dead_reason": null},
                    {"id": "o:child:b", "state": "dead", "finished": true, "result": null, "error": {"code": "x"}, "dead_reason": "exhausted"},
                    {"id": "o:child:c", "state": "missing"}]}"#,
            ),
        ];
        for (recorded_kind, raw) in canned {
            let journaled = WaitOutcome::from_json(&serde_json::from_str(raw).unwrap())
                .unwrap_or_else(|| panic!("a journal this machine reads: {raw}"));
            for kind in WaitKind::ALL {
                for due in [false, true] {
                    let seen = Seen {
                        signal: Some(signal()),
                        children: Some((vec![child("other", "received")], false)),
                        due,
                    };
                    assert_eq!(
                        decide(kind, Some(journaled.clone()), seen),
                        Decision::Over(journaled.clone()),
                        "{raw} recorded by {recorded_kind:?}, replayed as {kind:?}"
                    );
                }
            }
        }
        let children = WaitOutcome::from_json(&serde_json::from_str(canned[3].1).unwrap())
            .and_then(WaitOutcome::into_children)
            .unwrap();
        assert_eq!(children[0].result, Some(json!({ "n": 2 })));
        assert_eq!(children[1].dead_reason.as_deref(), Some("exhausted"));
        assert_eq!(
            (children[2].state.as_str(), children[2].finished),
            ("missing", None)
        );
    }

    /// Every kind of `waiting`, as the column holds it, both ways.
    #[test]
    fn every_waiting_is_written_and_read_as_one_type() {
        let until = DateTime::parse_from_rfc3339("2026-12-06T10:00:00Z")
            .unwrap()
            .with_timezone(&Utc);
        let at = "2026-12-06T10:00:00Z";
        let cases = [
            (
                Waiting::Sleep {
                    name: "nap".into(),
                    until,
                },
                json!({ "kind": "sleep", "name": "nap", "until": at }),
            ),
            (
                Waiting::Signal {
                    name: "go".into(),
                    until,
                },
                json!({ "kind": "signal", "name": "go", "until": at }),
            ),
            (
                Waiting::Approval {
                    name: "approval:t1".into(),
                    until,
                    tool: ApprovalCall {
                        tool_call_id: "t1".into(),
                        name: "refund".into(),
                        arguments: json!({}),
                    },
                },
                json!({ "kind": "approval", "name": "approval:t1", "until": at,
                        "tool": { "tool_call_id": "t1", "name": "refund", "arguments": {} } }),
            ),
            (
                Waiting::Children {
                    name: "join:1".into(),
                    until,
                    children: vec!["p:child:a".into()],
                    pending: 1,
                },
                json!({ "kind": "children", "name": "join:1", "until": at,
                        "children": ["p:child:a"], "pending": 1 }),
            ),
            (
                Waiting::Budget {
                    until,
                    reserved: false,
                },
                json!({ "kind": "budget", "until": at }),
            ),
            (
                Waiting::Budget {
                    until,
                    reserved: true,
                },
                json!({ "kind": "budget", "until": at, "reserved": true }),
            ),
            (
                Waiting::Concurrency {
                    key: "cust-1".into(),
                },
                json!({ "kind": "concurrency", "key": "cust-1" }),
            ),
            (
                Waiting::Throttle {
                    key: "cust-1".into(),
                    until,
                },
                json!({ "kind": "throttle", "key": "cust-1", "until": at }),
            ),
            (
                Waiting::Provider {
                    key: "openai:gpt".into(),
                    queued_at: None,
                },
                json!({ "kind": "provider", "key": "openai:gpt" }),
            ),
            (
                Waiting::Provider {
                    key: "openai:gpt".into(),
                    queued_at: Some(until),
                },
                json!({ "kind": "provider", "key": "openai:gpt", "queued_at": at }),
            ),
        ];
        for kind in WaitKind::ALL {
            assert!(
                cases.iter().any(|(w, _)| w.kind() == kind),
                "{kind:?} has a case"
            );
        }
        for (waiting, json) in cases {
            assert_eq!(waiting.to_json()["kind"], waiting.kind().as_str());
            let read = Waiting::from_json(&json).unwrap_or_else(|| panic!("{json}"));
            assert_eq!(read, waiting);
            assert_eq!(
                Waiting::from_json(&waiting.to_json()).as_ref(),
                Some(&waiting)
            );
        }
        assert_eq!(Waiting::from_json(&json!({ "kind": "nap" })), None);
    }
}
