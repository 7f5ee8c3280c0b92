//! Map-reduce over a document: split it into chunks, summarise every chunk
//! at once (one model call per chunk, each journaled under its own key),
//! then one call that combines the summaries. After a crash, the chunks
//! already summarised replay from the journal; only the others are asked.

use onceflow::{Context, InvalidInput, StepError, Workflow};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// Summarises a document chunk by chunk, then as a whole.
pub struct Digest;

#[derive(Serialize, Deserialize)]
pub struct Document {
    /// The text to summarise.
    pub text: String,
    /// Largest chunk, in characters (split at whitespace).
    #[serde(default = "default_chunk")]
    pub chunk_chars: usize,
}

fn default_chunk() -> usize {
    4_000
}

#[derive(Serialize, Deserialize)]
pub struct Summary {
    pub chunks: usize,
    pub summary: String,
}

/// At most this many chunks (so one job's calls stay bounded).
pub const MAX_CHUNKS: usize = 64;

/// `text` in chunks of at most `max` characters, split at whitespace.
pub fn chunks(text: &str, max: usize) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut current = String::new();
    for word in text.split_whitespace() {
        if !current.is_empty() && current.len() + 1 + word.len() > max {
            out.push(std::mem::take(&mut current));
        }
        if !current.is_empty() {
            current.push(' ');
        }
        current.push_str(word);
    }
    if !current.is_empty() {
        out.push(current);
    }
    out
}

fn ask(content: String) -> Value {
    json!({ "model": "gpt-4o-mini", "messages": [{ "role": "user", "content": content }] })
}

fn text_of(answer: &Value) -> String {
    answer["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

impl Workflow for Digest {
    const NAME: &'static str = "digest";
    type Input = Document;
    type Output = Summary;

    fn validate(doc: &Document) -> Result<(), InvalidInput> {
        if doc.chunk_chars < 100 {
            return Err(InvalidInput::new(
                "input.chunk_chars",
                "must be at least 100",
            ));
        }
        let n = chunks(&doc.text, doc.chunk_chars).len();
        if n == 0 || n > MAX_CHUNKS {
            return Err(InvalidInput::new(
                "input.text",
                format!("must make 1 to {MAX_CHUNKS} chunks of chunk_chars (makes {n})"),
            ));
        }
        Ok(())
    }

    async fn run(&self, ctx: &mut Context, doc: Document) -> Result<Summary, StepError> {
        let parts = chunks(&doc.text, doc.chunk_chars);
        // Map: one call per chunk, all at once, under `job:{id}:chunk-{i}`.
        let names: Vec<String> = (0..parts.len()).map(|i| format!("chunk-{i}")).collect();
        let requests: Vec<Value> = parts
            .iter()
            .map(|p| ask(format!("Summarise in one sentence:\n\n{p}")))
            .collect();
        let calls: Vec<(&str, &Value)> = names.iter().map(String::as_str).zip(&requests).collect();
        let summaries: Vec<String> = ctx
            .generate_all(&calls)
            .await?
            .iter()
            .map(text_of)
            .collect();
        // Reduce: one call under `job:{id}:combine`.
        let combined = ctx
            .generate(
                "combine",
                &ask(format!(
                    "Combine into one paragraph:\n\n{}",
                    summaries.join("\n")
                )),
            )
            .await?;
        Ok(Summary {
            chunks: parts.len(),
            summary: text_of(&combined),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::chunks;

    #[test]
    fn chunks_split_at_whitespace_within_the_bound() {
        let text = "alpha beta gamma delta epsilon";
        assert_eq!(
            chunks(text, 11),
            vec!["alpha beta", "gamma delta", "epsilon"]
        );
        assert_eq!(chunks("  ", 10), Vec::<String>::new());
        assert!(chunks(text, 11).iter().all(|c| c.len() <= 11));
    }
}
