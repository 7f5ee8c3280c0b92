//! W3C trace context (`traceparent`), so one job is one trace across all its
//! attempts, nodes and outgoing requests.
//!
//! At intake a job gets a trace: the caller's (`traceparent` on
//! `POST /v1/jobs`) or a new one. It is stored with the job; every attempt
//! runs as a span of its own inside that trace, and every outgoing request
//! (model, webhook, tool) carries `traceparent: 00-{trace id}-{attempt span}-01`,
//! so the provider's and the consumer's traces continue the job's.

use std::fmt;

use rand::Rng;

/// A trace id and a span id, as in a `traceparent` header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent {
    /// The trace: one per job, across all its attempts.
    pub trace_id: [u8; 16],
    /// The parent span (the caller's, or one attempt of the job).
    pub span_id: [u8; 8],
    /// The `sampled` trace flag.
    pub sampled: bool,
}

impl TraceParent {
    /// A new trace (the root of a job that came without one).
    pub fn new_root() -> Self {
        let mut rng = rand::rng();
        TraceParent {
            trace_id: nonzero(|| rng.random()),
            span_id: nonzero(|| rng.random()),
            sampled: true,
        }
    }

    /// A new span in the same trace (one attempt of the job).
    pub fn child(&self) -> Self {
        let mut rng = rand::rng();
        TraceParent {
            span_id: nonzero(|| rng.random()),
            ..*self
        }
    }

    /// Parses a `traceparent` header (version 00); `None` when it is invalid.
    pub fn parse(header: &str) -> Option<Self> {
        let mut parts = header.trim().split('-');
        let (version, trace, span, flags) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        if version.len() != 2
            || version == "ff"
            || trace.len() != 32
            || span.len() != 16
            || flags.len() != 2
        {
            return None;
        }
        if version == "00" && parts.next().is_some() {
            return None;
        }
        let mut trace_id = [0u8; 16];
        let mut span_id = [0u8; 8];
        hex::decode_to_slice(trace, &mut trace_id).ok()?;
        hex::decode_to_slice(span, &mut span_id).ok()?;
        let flags = u8::from_str_radix(flags, 16).ok()?;
        if trace_id == [0; 16] || span_id == [0; 8] {
            return None;
        }
        Some(TraceParent {
            trace_id,
            span_id,
            sampled: flags & 1 == 1,
        })
    }

    /// The trace id as 32 hex digits.
    pub fn trace_id_hex(&self) -> String {
        hex::encode(self.trace_id)
    }
}

impl fmt::Display for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "00-{}-{}-{:02x}",
            hex::encode(self.trace_id),
            hex::encode(self.span_id),
            u8::from(self.sampled)
        )
    }
}

fn nonzero<const N: usize>(mut draw: impl FnMut() -> [u8; N]) -> [u8; N] {
    loop {
        let v = draw();
        if v != [0; N] {
            return v;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_rejects_bad_headers() {
        let h = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let tp = TraceParent::parse(h).unwrap();
        assert_eq!(tp.to_string(), h);
        assert_eq!(tp.trace_id_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        let child = tp.child();
        assert_eq!(child.trace_id, tp.trace_id);
        assert_ne!(child.span_id, tp.span_id);
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473x-00f067aa0ba902b7-01",
        ] {
            assert!(TraceParent::parse(bad).is_none(), "{bad}");
        }
        let root = TraceParent::new_root();
        assert_eq!(TraceParent::parse(&root.to_string()), Some(root));
    }
}
