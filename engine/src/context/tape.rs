//! The tape of a streamed answer: what was shown before, what the new
//! stream repeats, and where the next chunk goes.

use crate::store::streams::StreamRow;

/// A streamed call's place in its journal: what was shown before (the
/// latest generation's text), how much of it the new stream has repeated,
/// and where the next chunk goes.
#[derive(Debug)]
pub(crate) struct Tape {
    /// The generation chunks are journaled in.
    pub(crate) generation: i32,
    next_offset: i32,
    /// What watchers were shown of this generation before this attempt.
    shown: String,
    /// This attempt's text so far.
    got: String,
    /// Whether the new stream is still repeating `shown`.
    verifying: bool,
}

impl Tape {
    pub(crate) fn new(journaled: crate::store::streams::Journaled) -> Self {
        Tape {
            generation: journaled.generation.max(1),
            next_offset: journaled.next_offset,
            verifying: !journaled.text.is_empty(),
            shown: journaled.text,
            got: String::new(),
        }
    }

    /// Takes the texts that arrived; returns the rows to journal.
    pub(crate) fn accept(&mut self, texts: &[String]) -> Vec<StreamRow> {
        for t in texts {
            self.got.push_str(t);
        }
        if !self.verifying {
            return texts.iter().map(|t| self.chunk(t.clone())).collect();
        }
        let (shown, got) = (self.shown.as_bytes(), self.got.as_bytes());
        if got.len() <= shown.len() {
            if shown.starts_with(got) {
                return Vec::new();
            }
        } else if got.starts_with(shown) {
            // Past what was shown: the rest continues this generation, one
            // row per text as a stream that never broke would have written
            // (the text that straddles the end of what was shown, cut).
            self.verifying = false;
            let mut upto = self.got.len() - texts.iter().map(String::len).sum::<usize>();
            let mut rows = Vec::new();
            for t in texts {
                let end = upto + t.len();
                if end > self.shown.len() {
                    let from = self.shown.len().max(upto) - upto;
                    rows.push(self.chunk(t[from..].to_owned()));
                }
                upto = end;
            }
            return rows;
        }
        self.reset()
    }

    /// The stream ended: an answer that stopped inside what was shown is a
    /// different answer.
    pub(crate) fn finish(&mut self) -> Vec<StreamRow> {
        if self.verifying && self.got.len() < self.shown.len() {
            self.reset()
        } else {
            Vec::new()
        }
    }

    fn chunk(&mut self, text: String) -> StreamRow {
        let row = StreamRow {
            offset: self.next_offset,
            kind: "chunk",
            text,
        };
        self.next_offset += 1;
        row
    }

    /// A new generation, announced by a reset with its reason, holding the
    /// new answer from its start.
    fn reset(&mut self) -> Vec<StreamRow> {
        let at = self
            .shown
            .bytes()
            .zip(self.got.bytes())
            .take_while(|(a, b)| a == b)
            .count();
        let reason = format!(
            "the provider's answer to the repeated request differs from the {} bytes already shown, \
             from byte {at}; the answer restarts as generation {}",
            self.shown.len(),
            self.generation + 1
        );
        self.generation += 1;
        self.next_offset = 0;
        self.verifying = false;
        let mut rows = vec![StreamRow {
            offset: -1,
            kind: "reset",
            text: reason,
        }];
        if !self.got.is_empty() {
            let all = self.got.clone();
            rows.push(self.chunk(all));
        }
        rows
    }
}

#[cfg(test)]
mod tape_tests {
    use super::*;
    use crate::store::streams::Journaled;

    fn texts(rows: &[StreamRow]) -> Vec<(i32, &str, &str)> {
        rows.iter()
            .map(|r| (r.offset, r.kind, r.text.as_str()))
            .collect()
    }

    #[test]
    fn a_fresh_stream_journals_every_chunk_in_generation_one() {
        let mut t = Tape::new(Journaled::default());
        assert_eq!(t.generation, 1);
        let rows = t.accept(&["a".into(), "b".into()]);
        assert_eq!(texts(&rows), vec![(0, "chunk", "a"), (1, "chunk", "b")]);
        assert!(t.finish().is_empty());
    }

    #[test]
    fn a_replayed_stream_is_verified_and_continues_after_what_was_shown() {
        let mut t = Tape::new(Journaled {
            generation: 1,
            text: "hello wor".into(),
            next_offset: 3,
        });
        assert!(t.accept(&["hel".into()]).is_empty());
        assert!(t.accept(&["lo ".into(), "wo".into()]).is_empty());
        let rows = t.accept(&["rld".into()]);
        assert_eq!(texts(&rows), vec![(3, "chunk", "ld")]);
        assert_eq!(t.generation, 1);
        assert_eq!(texts(&t.accept(&["!".into()])), vec![(4, "chunk", "!")]);
        // Texts that arrive together past what was shown keep a row each,
        // as a stream that never broke would have journaled them.
        let mut t = Tape::new(Journaled {
            generation: 1,
            text: "hello wor".into(),
            next_offset: 3,
        });
        let rows = t.accept(&["hel".into(), "lo wo".into(), "rld".into(), "!".into()]);
        assert_eq!(texts(&rows), vec![(3, "chunk", "ld"), (4, "chunk", "!")]);
    }

    #[test]
    fn a_different_answer_resets_once_into_a_new_generation() {
        let mut t = Tape::new(Journaled {
            generation: 1,
            text: "hello".into(),
            next_offset: 2,
        });
        assert!(t.accept(&["he".into()]).is_empty());
        let rows = t.accept(&["y".into()]);
        assert_eq!(rows[0].kind, "reset");
        assert_eq!(rows[0].offset, -1);
        assert_eq!(texts(&rows[1..]), vec![(0, "chunk", "hey")]);
        assert_eq!(t.generation, 2);
        assert_eq!(texts(&t.accept(&["!".into()])), vec![(1, "chunk", "!")]);
        // A shorter answer that stopped inside what was shown differs too.
        let mut t = Tape::new(Journaled {
            generation: 2,
            text: "hello".into(),
            next_offset: 1,
        });
        assert!(t.accept(&["hel".into()]).is_empty());
        let rows = t.finish();
        assert_eq!(rows[0].kind, "reset");
        assert_eq!(t.generation, 3);
    }
}
