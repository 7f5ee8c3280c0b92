//! The wait machine, pure: what a wait is (`WaitKind`), how it ends
//! (`WaitOutcome`, journaled as the same JSON it always was), and the one
//! function that decides it from its row, the signal it may take and the
//! database's clock ([`decide`]). No I/O: the store runs the statements
//! around it (`store::waits`), the context reads the outcome back
//! (`context::wait`), and a table test covers every kind × state × timing
//! without a database.
//!
//! On disk, in `waits.outcome`:
//!
//! | outcome | JSON |
//! |---|---|
//! | the timer fired | `{"slept": true}` |
//! | a signal was taken | `{"signal": {"id": "<signal id>", "payload": <JSON>}}` |
//! | no signal before the due time | `{"timeout": true}` |

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// What a job waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitKind {
    /// A timer (`ctx.sleep`, `ctx.sleep_until`).
    Sleep,
    /// A signal of a name, with a timeout (`ctx.wait_for_signal`).
    Signal,
    /// A person's decision on a tool call: a signal named `approval:{tool_call_id}`.
    Approval,
}

impl WaitKind {
    /// The name stored and shown (`"waiting": {"kind": …}`).
    pub fn as_str(self) -> &'static str {
        match self {
            WaitKind::Sleep => "sleep",
            WaitKind::Signal => "signal",
            WaitKind::Approval => "approval",
        }
    }

    /// Whether a signal of the wait's name ends it.
    pub fn takes_signals(self) -> bool {
        matches!(self, WaitKind::Signal | WaitKind::Approval)
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
}

impl WaitOutcome {
    /// The outcome as journaled.
    pub fn to_json(&self) -> Value {
        serde_json::to_value(self).expect("a wait outcome serialises")
    }

    /// An outcome read back from the journal; `None` for one this machine
    /// never writes (a join's outcome is its own).
    pub fn from_json(value: &Value) -> Option<Self> {
        serde_json::from_value(value.clone()).ok()
    }

    /// The signal's payload, when a signal ended the wait.
    pub fn into_signal(self) -> Option<TakenSignal> {
        match self {
            WaitOutcome::Signal(s) => Some(s),
            WaitOutcome::Slept(_) | WaitOutcome::Timeout(_) => None,
        }
    }
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

/// Decides a wait of `kind` from what the store read in one transaction:
/// the outcome journaled before (a replay returns it, whatever else
/// changed), the oldest signal of its name it may take (`None` for a
/// timer, or when none was sent), and whether the due time has passed by
/// the database's clock. A signal wins over a timeout that fell due at the
/// same moment: it was sent before the job looked.
pub fn decide(
    kind: WaitKind,
    journaled: Option<WaitOutcome>,
    signal: Option<TakenSignal>,
    due: bool,
) -> Decision {
    if let Some(outcome) = journaled {
        return Decision::Over(outcome);
    }
    match (kind.takes_signals(), signal, due) {
        (true, Some(signal), _) => Decision::Over(WaitOutcome::Signal(signal)),
        (false, _, true) => Decision::Over(WaitOutcome::Slept(true)),
        (true, None, true) => Decision::Over(WaitOutcome::Timeout(true)),
        (_, _, false) => Decision::Wait,
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

    /// Every kind × journaled or not × a signal or not × due or not.
    #[test]
    fn the_table_of_every_kind_state_and_timing() {
        use Decision::{Over, Wait};
        use WaitKind::{Approval, Signal, Sleep};
        let slept = WaitOutcome::Slept(true);
        let timeout = WaitOutcome::Timeout(true);
        let took = WaitOutcome::Signal(signal());
        let before = WaitOutcome::Signal(TakenSignal {
            id: "earlier".into(),
            payload: json!(1),
        });
        #[rustfmt::skip]
        let table: Vec<(WaitKind, Option<WaitOutcome>, bool, bool, Decision)> = vec![
            // kind      journaled             signal due    decision
            (Sleep,    None,                  false, false, Wait),
            (Sleep,    None,                  false, true,  Over(slept.clone())),
            (Sleep,    None,                  true,  false, Wait), // a timer takes no signal
            (Sleep,    None,                  true,  true,  Over(slept.clone())),
            (Sleep,    Some(slept.clone()),   false, false, Over(slept.clone())),
            (Sleep,    Some(slept.clone()),   true,  true,  Over(slept.clone())),
            (Signal,   None,                  false, false, Wait),
            (Signal,   None,                  false, true,  Over(timeout.clone())),
            (Signal,   None,                  true,  false, Over(took.clone())),
            (Signal,   None,                  true,  true,  Over(took.clone())), // the signal wins
            (Signal,   Some(timeout.clone()), true,  false, Over(timeout.clone())), // a replay keeps it
            (Signal,   Some(before.clone()),  true,  true,  Over(before.clone())),
            (Approval, None,                  false, false, Wait),
            (Approval, None,                  false, true,  Over(timeout.clone())),
            (Approval, None,                  true,  false, Over(took.clone())),
            (Approval, None,                  true,  true,  Over(took.clone())),
            (Approval, Some(took.clone()),    false, true,  Over(took.clone())),
        ];
        for (kind, journaled, has_signal, due, expected) in table {
            let got = decide(kind, journaled.clone(), has_signal.then(signal), due);
            assert_eq!(
                got, expected,
                "{kind:?} journaled={journaled:?} signal={has_signal} due={due}"
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
        ] {
            assert_eq!(outcome.to_json(), json);
            assert_eq!(WaitOutcome::from_json(&json), Some(outcome));
        }
        // A join's outcome is not the machine's.
        assert_eq!(WaitOutcome::from_json(&json!({ "children": [] })), None);
    }
}
