//! Server-sent events of streamed answers, format-neutral: [`Events`]
//! splits the bytes into events' data, which a
//! [`WireFormat`](super::format::WireFormat) reads into an
//! [`Answer`](super::format::Answer).

/// Splits a byte stream into the `data:` payloads of its events.
#[derive(Debug, Default)]
pub struct Events {
    buffer: Vec<u8>,
    /// Bytes taken in all.
    pub received: usize,
}

impl Events {
    /// Bytes of an event not complete yet.
    pub fn pending(&self) -> usize {
        self.buffer.len()
    }

    /// Adds `bytes`; returns the data of every event now complete.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.received += bytes.len();
        self.buffer.extend_from_slice(bytes);
        let mut out = Vec::new();
        loop {
            let text = &self.buffer;
            // An event ends at a blank line (LF LF, or CR LF CR LF).
            let end = text
                .windows(2)
                .position(|w| w == b"\n\n")
                .map(|i| (i, 2))
                .into_iter()
                .chain(
                    text.windows(4)
                        .position(|w| w == b"\r\n\r\n")
                        .map(|i| (i, 4)),
                )
                .min_by_key(|(i, _)| *i);
            let Some((at, len)) = end else { break };
            let event = String::from_utf8_lossy(&self.buffer[..at]).into_owned();
            self.buffer.drain(..at + len);
            let data: Vec<&str> = event
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(|d| d.strip_prefix(' ').unwrap_or(d))
                .collect();
            if !data.is_empty() {
                out.push(data.join("\n"));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_split_at_blank_lines_across_reads() {
        let mut e = Events::default();
        assert!(e.push(b"data: {\"a\"").is_empty());
        assert_eq!(
            e.push(b":1}\n\ndata: [DONE]\r\n\r\n"),
            vec!["{\"a\":1}", "[DONE]"]
        );
        assert_eq!(e.push(b": a comment\n\n"), Vec::<String>::new());
        assert_eq!(e.pending(), 0);
    }
}
