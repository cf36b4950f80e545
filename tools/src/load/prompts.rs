//! Prompt sets for load runs: built-in code, chat and long-context summarization sets, or a JSONL file of `{"prompt"|"messages", "max_tokens"}` lines.

use std::path::Path;

use rand::rngs::StdRng;
use rand::Rng;
use serde::{Deserialize, Serialize};

use super::LoadError;

/// One chat message.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

/// What a request sends: plain text or chat messages.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PromptInput {
    Text(String),
    Messages(Vec<Message>),
}

/// One prompt of a set, with its own output length when the file gave one.
#[derive(Clone, Debug, PartialEq)]
pub struct LoadPrompt {
    pub input: PromptInput,
    pub max_tokens: Option<usize>,
}

/// Where prompts come from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PromptSource {
    Code,
    Chat,
    Summarize,
    File(String),
}

impl PromptSource {
    /// `code`, `chat`, `summarize` or a path to a `.jsonl` file.
    pub fn parse(s: &str) -> Result<Self, LoadError> {
        Ok(match s {
            "code" => PromptSource::Code,
            "chat" => PromptSource::Chat,
            "summarize" | "long" => PromptSource::Summarize,
            p if p.ends_with(".jsonl") || Path::new(p).is_file() => PromptSource::File(p.into()),
            other => {
                return Err(LoadError::Invalid(format!(
                    "unknown prompt set '{other}' (code, chat, summarize, or a .jsonl file)"
                )))
            }
        })
    }
}

/// Approximate words per token of English text and code for the length controls (the tool has no
/// tokenizer; the server's `usage.prompt_tokens` reports the real count).
const WORDS_PER_TOKEN: f64 = 0.75;

/// Load a prompt set; `input_len` (approximate tokens) pads every prompt with context text.
pub fn load(source: &PromptSource, input_len: Option<usize>) -> Result<Vec<LoadPrompt>, LoadError> {
    let mut prompts = match source {
        PromptSource::Code => CODE
            .iter()
            .map(|p| LoadPrompt {
                input: PromptInput::Text((*p).into()),
                max_tokens: None,
            })
            .collect(),
        PromptSource::Chat => CHAT
            .iter()
            .map(|q| LoadPrompt {
                input: PromptInput::Messages(vec![Message {
                    role: "user".into(),
                    content: (*q).into(),
                }]),
                max_tokens: None,
            })
            .collect(),
        PromptSource::Summarize => (0..16)
            .map(|i| LoadPrompt {
                input: PromptInput::Messages(vec![Message {
                    role: "user".into(),
                    content: format!(
                        "Summarize the following report in three sentences.\n\n{}",
                        document(i, input_len.unwrap_or(1024))
                    ),
                }]),
                max_tokens: None,
            })
            .collect(),
        PromptSource::File(path) => read_jsonl(Path::new(path))?,
    };
    if let (Some(n), false) = (input_len, matches!(source, PromptSource::Summarize)) {
        for (i, p) in prompts.iter_mut().enumerate() {
            pad(p, n, i);
        }
    }
    if prompts.is_empty() {
        return Err(LoadError::Invalid("the prompt set is empty".into()));
    }
    Ok(prompts)
}

fn words(s: &str) -> usize {
    s.split_whitespace().count()
}

/// Prefix the prompt with context until it is about `tokens` long.
fn pad(p: &mut LoadPrompt, tokens: usize, salt: usize) {
    let want_words = (tokens as f64 * WORDS_PER_TOKEN) as usize;
    let text = match &mut p.input {
        PromptInput::Text(t) => t,
        PromptInput::Messages(m) => match m.last_mut() {
            Some(last) => &mut last.content,
            None => return,
        },
    };
    let have = words(text);
    if have >= want_words {
        return;
    }
    let ctx = document(
        salt,
        ((want_words - have) as f64 / WORDS_PER_TOKEN) as usize,
    );
    *text = format!("{ctx}\n\n{text}");
}

/// A deterministic report of about `tokens` tokens, different for each `i`.
fn document(i: usize, tokens: usize) -> String {
    let want_words = (tokens as f64 * WORDS_PER_TOKEN).max(1.0) as usize;
    let mut out = String::new();
    let mut k = i;
    // A running count (recounting the whole text per paragraph was quadratic in its length).
    let mut n_words = 0;
    while n_words < want_words {
        let para = PARAGRAPHS[k % PARAGRAPHS.len()];
        let section = format!("Section {}. {para}\n", k - i + 1);
        n_words += words(&section);
        out.push_str(&section);
        k += 1 + i % 3;
    }
    out
}

fn read_jsonl(path: &Path) -> Result<Vec<LoadPrompt>, LoadError> {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Line {
        prompt: Option<String>,
        messages: Option<Vec<Message>>,
        max_tokens: Option<usize>,
    }
    let text = std::fs::read_to_string(path)
        .map_err(|e| LoadError::Invalid(format!("cannot read {}: {e}", path.display())))?;
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let l: Line = serde_json::from_str(line)
            .map_err(|e| LoadError::Invalid(format!("{}:{}: {e}", path.display(), n + 1)))?;
        let input = match (l.prompt, l.messages) {
            (Some(p), None) => PromptInput::Text(p),
            (None, Some(m)) => PromptInput::Messages(m),
            _ => {
                return Err(LoadError::Invalid(format!(
                    "{}:{}: give exactly one of \"prompt\" and \"messages\"",
                    path.display(),
                    n + 1
                )))
            }
        };
        if l.max_tokens == Some(0) {
            return Err(LoadError::Invalid(format!(
                "{}:{}: max_tokens must be at least 1",
                path.display(),
                n + 1
            )));
        }
        out.push(LoadPrompt {
            input,
            max_tokens: l.max_tokens,
        });
    }
    Ok(out)
}

/// Pick a prompt index uniformly.
pub fn pick(rng: &mut StdRng, n: usize) -> usize {
    rng.gen_range(0..n)
}

const CODE: &[&str] = &[
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "def is_prime(n: int) -> bool:\n    \"\"\"Return True if n is a prime number.\"\"\"\n",
    "def quicksort(xs):\n    \"\"\"Sort a list with quicksort and return a new list.\"\"\"\n",
    "fn gcd(a: u64, b: u64) -> u64 {\n    // Euclid's algorithm\n",
    "class Stack:\n    \"\"\"A last-in first-out stack backed by a list.\"\"\"\n\n    def __init__(self):\n",
    "function debounce(fn, ms) {\n  // Call fn at most once every ms milliseconds\n",
    "def binary_search(xs, target):\n    \"\"\"Return the index of target in the sorted list xs, or -1.\"\"\"\n",
    "SELECT customer_id, SUM(amount) AS total\nFROM orders\n",
    "def parse_csv_line(line: str) -> list[str]:\n    \"\"\"Split one CSV line, honouring double quotes.\"\"\"\n",
    "#include <stdio.h>\n\n/* Print the first n squares. */\nvoid print_squares(int n) {\n",
    "def word_count(text):\n    \"\"\"Count how often each word occurs in text.\"\"\"\n    counts = {}\n",
    "impl Matrix {\n    /// Multiply two matrices.\n    pub fn mul(&self, other: &Matrix) -> Matrix {\n",
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n",
    "async function fetchJson(url) {\n  // Fetch a URL and parse its JSON body, throwing on HTTP errors\n",
    "def flatten(nested):\n    \"\"\"Flatten a list of lists by one level.\"\"\"\n",
    "def levenshtein(a: str, b: str) -> int:\n    \"\"\"Edit distance between two strings.\"\"\"\n",
];

const CHAT: &[&str] = &[
    "What is the capital of France?",
    "Explain what a hash table is in two sentences.",
    "Give me three tips for writing clear emails.",
    "What causes the seasons on Earth?",
    "Write a haiku about autumn leaves.",
    "How do vaccines train the immune system?",
    "What is the difference between a list and a tuple in Python?",
    "Suggest a name for a bakery that sells only bread.",
    "Why is the sky blue?",
    "Describe the water cycle for a ten-year-old.",
    "What are the main causes of inflation?",
    "How does a binary search work?",
    "List four planets of the solar system and one fact about each.",
    "What should I pack for a weekend hiking trip?",
    "Translate 'good morning, how are you?' into Spanish.",
    "What is recursion? Give a short example.",
];

const PARAGRAPHS: &[&str] = &[
    "The city council met on Tuesday to review the budget for the coming year. Members agreed that road repairs and the public library would receive more money, while the parks department would keep its current funding. Several residents spoke about the need for better street lighting near the schools.",
    "Rainfall in the region was well below average for the third year in a row. Farmers reported smaller harvests of wheat and barley, and the water authority asked households to limit garden watering to two days a week. Reservoir levels stood at forty percent of capacity at the end of the summer.",
    "The company opened a new warehouse near the harbour, which will employ about two hundred people. Managers said the site would shorten delivery times for customers in the north by a full day. The building uses solar panels on its roof and collects rainwater for cleaning.",
    "A survey of local businesses found that most owners expect sales to grow slowly over the next twelve months. Restaurants and shops in the old town reported more visitors than last year, while some manufacturers worried about the rising cost of energy and raw materials.",
    "The regional hospital finished the renovation of its emergency department. Patients now wait in a larger hall with more seats, and the number of treatment rooms rose from twelve to twenty. Staff said the new layout lets nurses see more patients from one station.",
    "Students at the technical college built a small satellite that will be launched next spring. The device measures temperature and radiation in low orbit and sends the data to a ground station on the campus roof. The project took three years and involved forty students.",
    "The railway operator announced new timetables that add an early morning train between the two largest towns. Commuters had asked for the change for several years. The operator also plans to replace the oldest carriages by the end of next year.",
    "Volunteers planted more than five thousand trees along the river banks this autumn. The trees should reduce erosion, give shade to the water and provide homes for birds. The environmental group that organised the event hopes to double the number next year.",
];
