//! Workloads: what arrives, when, with which prompt.
//!
//! A request's prompt is a list of *segments* `(content id, tokens)`; token `j` of a
//! segment is a fixed function of its id and `j` ([`token_at`]). Two prompts that share
//! a run of leading segments therefore share those tokens exactly, and kvr's chained
//! block hashes see the shared prefix at any block size — which is how a Mooncake trace's
//! 512-token `hash_ids` become finer blocks: equal ids at equal positions give equal
//! tokens, and the sequence hash chains each block on everything before it. A segment cut
//! short (a prompt's last, partial 512-token chunk) is the start of the same content, so a
//! later prompt that holds the whole chunk shares the cut prefix too.

use std::io::BufRead;
use std::path::Path;

use kvr::cost::SelectionRng;

/// Tokens per `hash_id` in a Mooncake trace (REFERENCE.md §6).
pub(crate) const MOONCAKE_CHUNK_TOKENS: u32 = 512;

/// Vocabulary the synthetic tokens are drawn from (Llama-3's size).
const VOCAB: u64 = 128_256;

/// One request of a workload.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Request {
    /// Arrival time, ms from the workload's start (before `--speed` scaling).
    pub arrival_ms: f64,
    /// The prompt, as content segments.
    pub segments: Vec<(u64, u32)>,
    pub input_tokens: u32,
    pub output_tokens: u32,
    /// The conversation this turn belongs to (built-in workload only).
    pub session: Option<u64>,
    /// Content id of the tokens the request generates (token `j` of the answer is
    /// [`token_at`]`(output_content, j)`): a later turn whose prompt holds the answer as
    /// segment `(output_content, output_tokens)` reuses the blocks the answer filled.
    pub output_content: u64,
    /// The previous turn of its conversation (an index into the workload's requests) and
    /// the user's think time after that turn's answer, ms: the turn arrives then (closed
    /// loop), not at `arrival_ms`. `None`: an open-loop arrival at `arrival_ms`.
    pub follows: Option<(u32, f64)>,
}

impl Request {
    /// Writes the prompt's tokens into `out` (cleared first).
    pub(crate) fn tokens_into(&self, out: &mut Vec<u32>) {
        out.clear();
        out.reserve(self.input_tokens as usize);
        for &(id, len) in &self.segments {
            out.extend((0..len).map(|j| token_at(id, j)));
        }
    }
}

/// Content ids at or above this are unique per request (outputs nobody reuses).
pub(crate) const UNIQUE_CONTENT: u64 = 1 << 62;

/// Token `j` of content `id`: SplitMix64 of the pair, reduced to the vocabulary.
pub(crate) fn token_at(id: u64, j: u32) -> u32 {
    let mut z = id
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(u64::from(j).wrapping_mul(0xD1B5_4A32_D192_ED03))
        .wrapping_add(0x632B_E59B_D9B3_E8A5);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    ((z ^ (z >> 31)) % VOCAB) as u32
}

/// A named list of requests in arrival order.
#[derive(Clone, Debug)]
pub(crate) struct Workload {
    /// What it is: "built-in" or the trace's path.
    pub name: String,
    pub requests: Vec<Request>,
    /// Parameters of the built-in generator (empty for traces), for the report.
    pub params: Vec<(&'static str, f64)>,
}

impl Workload {
    pub(crate) fn prompt_tokens(&self) -> u64 {
        self.requests
            .iter()
            .map(|r| u64::from(r.input_tokens))
            .sum()
    }

    /// Span from the first to the last arrival, ms.
    pub(crate) fn duration_ms(&self) -> f64 {
        match (self.requests.first(), self.requests.last()) {
            (Some(a), Some(b)) => b.arrival_ms - a.arrival_ms,
            _ => 0.0,
        }
    }
}

/// One record of a Mooncake trace (REFERENCE.md §6); unknown fields are ignored.
#[derive(serde::Deserialize)]
struct MooncakeLine {
    timestamp: f64,
    input_length: u64,
    output_length: u64,
    hash_ids: Vec<u64>,
}

/// Reads a Mooncake JSONL trace. Any malformed line is an error naming its number and
/// the problem; so is a trace without requests. Blank lines are skipped. Arrivals must
/// not go back in time (the traces are sorted; a shuffled file is more likely a mistake
/// than a workload).
pub(crate) fn load_mooncake(path: &Path) -> Result<Workload, String> {
    let file = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut requests = Vec::new();
    let mut last_ts = f64::NEG_INFINITY;
    for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
        let n = i + 1;
        let at = |msg: String| format!("{}:{n}: {msg}", path.display());
        let line = line.map_err(|e| at(format!("cannot read: {e}")))?;
        if line.trim().is_empty() {
            continue;
        }
        let rec: MooncakeLine =
            serde_json::from_str(&line).map_err(|e| at(format!("not a trace record: {e}")))?;
        requests.push(mooncake_request(&rec, last_ts, requests.len()).map_err(at)?);
        last_ts = rec.timestamp;
    }
    if requests.is_empty() {
        return Err(format!("{}: the trace holds no requests", path.display()));
    }
    Ok(Workload {
        name: path.display().to_string(),
        requests,
        params: Vec::new(),
    })
}

fn mooncake_request(rec: &MooncakeLine, last_ts: f64, n: usize) -> Result<Request, String> {
    let chunk = u64::from(MOONCAKE_CHUNK_TOKENS);
    if !rec.timestamp.is_finite() || rec.timestamp < 0.0 {
        return Err(format!("timestamp {} is not a time", rec.timestamp));
    }
    if rec.timestamp < last_ts {
        return Err(format!(
            "timestamp {} is earlier than the previous line's {last_ts}",
            rec.timestamp
        ));
    }
    if rec.input_length == 0 {
        return Err("input_length is 0".into());
    }
    if rec.input_length > u64::from(u32::MAX) || rec.output_length > u64::from(u32::MAX) {
        return Err("input_length or output_length is too large".into());
    }
    let want = rec.input_length.div_ceil(chunk);
    if rec.hash_ids.len() as u64 != want {
        return Err(format!(
            "{} hash_ids for input_length {} (expected {want}: one per {chunk} tokens)",
            rec.hash_ids.len(),
            rec.input_length
        ));
    }
    let mut left = rec.input_length;
    let segments = rec
        .hash_ids
        .iter()
        .map(|&id| {
            let len = left.min(chunk);
            left -= len;
            (id, len as u32)
        })
        .collect();
    Ok(Request {
        arrival_ms: rec.timestamp,
        segments,
        input_tokens: rec.input_length as u32,
        output_tokens: rec.output_length as u32,
        session: None,
        // The trace does not say what was generated: nothing reuses it.
        output_content: UNIQUE_CONTENT + n as u64,
        follows: None,
    })
}

/// Parameters of the built-in workload.
#[derive(Clone, Debug)]
pub(crate) struct GeneratorConfig {
    pub seed: u64,
    /// Sessions to generate (conversations, agent runs and single long prompts together).
    pub sessions: u32,
    /// Sessions started per second (Poisson).
    pub session_rate: f64,
    /// Distinct system prompts, chosen with Zipf-like popularity.
    pub system_prompts: u32,
    /// Distinct tool preambles; about half the conversations carry one.
    pub tool_preambles: u32,
    /// Share of sessions that are agent runs: a long tool preamble shared by every run of
    /// its agent (few agents), then many short turns (tool calls and their results) with
    /// short pauses.
    pub agent_share: f64,
    /// Share of sessions that are one long prompt of unique content (a document to
    /// summarise, retrieval results): little reuse, heavy prefill.
    pub unique_share: f64,
}

impl Default for GeneratorConfig {
    fn default() -> Self {
        GeneratorConfig {
            seed: 42,
            sessions: 1_200,
            session_rate: 2.0,
            system_prompts: 12,
            tool_preambles: 6,
            agent_share: 0.2,
            unique_share: 0.1,
        }
    }
}

fn uniform(rng: &mut SelectionRng, lo: u32, hi: u32) -> u32 {
    lo + (rng.next_u64() % u64::from(hi - lo + 1)) as u32
}

fn exponential(rng: &mut SelectionRng, mean: f64) -> f64 {
    -mean * (1.0 - rng.next_f64()).ln()
}

/// What kind of session the generator makes, and its turns' shape.
#[derive(Clone, Copy)]
enum SessionKind {
    Chat,
    Agent,
    Unique,
}

/// One generated turn before the arrivals are sorted: its session and place in it.
struct Turn {
    req: Request,
    session: u64,
    turn: u32,
    think_ms: f64,
}

/// The built-in workload: sessions started as a Poisson process, of three kinds
/// ([`GeneratorConfig::agent_share`], [`GeneratorConfig::unique_share`], the rest
/// conversations):
///
/// * **conversations** over shared system prompts (Zipf popularity) and, for half of
///   them, a tool preamble; 1–16 turns, each prompt the previous prompt, the assistant's
///   answer and a new user message (32–768 tokens), answers of 16–512 tokens, think times
///   of 8 s on average;
/// * **agent runs** of one of four agents (each a 4–12k-token tool preamble after a
///   system prompt): 4–24 short turns (a tool result of 16–256 tokens, a call of 16–128),
///   1.5 s pauses (the tool running);
/// * **single long prompts** of 4–16k unique tokens with 64–512-token answers.
///
/// A later turn of a session follows its predecessor ([`Request::follows`]): it arrives
/// its think time after the previous answer is complete, so a slower cluster sees later
/// turns later, as real users do. `arrival_ms` is the nominal time had the answer taken
/// 25 ms a token (kept for the order of the list and for open-loop tools).
/// Deterministic in `seed`.
pub(crate) fn generate(cfg: &GeneratorConfig) -> Workload {
    let mut rng = SelectionRng::from_seed(cfg.seed ^ 0x6B76_725F_7265_706C);
    let mut next_id: u64 = 1;
    let mut fresh = || {
        next_id += 1;
        next_id
    };
    let systems: Vec<(u64, u32)> = (0..cfg.system_prompts.max(1))
        .map(|_| (fresh(), uniform(&mut rng, 1_024, 4_096)))
        .collect();
    let tools: Vec<(u64, u32)> = (0..cfg.tool_preambles.max(1))
        .map(|_| (fresh(), uniform(&mut rng, 512, 2_048)))
        .collect();
    let agents: Vec<(u64, u32)> = (0..4)
        .map(|_| (fresh(), uniform(&mut rng, 4_096, 12_288)))
        .collect();
    // Zipf(1) popularity over system prompts.
    let weights: Vec<f64> = (0..systems.len()).map(|k| 1.0 / (k + 1) as f64).collect();
    let total: f64 = weights.iter().sum();

    let mut turns: Vec<Turn> = Vec::new();
    let mut start_ms = 0.0;
    for session in 0..u64::from(cfg.sessions) {
        start_ms += exponential(&mut rng, 1_000.0 / cfg.session_rate.max(1e-9));
        let mut pick = rng.next_f64() * total;
        let mut sys = systems.len() - 1;
        for (k, w) in weights.iter().enumerate() {
            if pick < *w {
                sys = k;
                break;
            }
            pick -= w;
        }
        let u = rng.next_f64();
        let kind = if u < cfg.agent_share {
            SessionKind::Agent
        } else if u < cfg.agent_share + cfg.unique_share {
            SessionKind::Unique
        } else {
            SessionKind::Chat
        };
        let mut segments = vec![systems[sys]];
        let n_turns = match kind {
            SessionKind::Chat => {
                if rng.next_u64().is_multiple_of(2) {
                    segments.push(tools[(rng.next_u64() % tools.len() as u64) as usize]);
                }
                1 + (exponential(&mut rng, 3.0) as u32).min(15)
            }
            SessionKind::Agent => {
                segments.push(agents[(rng.next_u64() % agents.len() as u64) as usize]);
                uniform(&mut rng, 4, 24)
            }
            SessionKind::Unique => {
                segments.push((fresh(), uniform(&mut rng, 4_096, 16_384)));
                1
            }
        };
        let mut at = start_ms;
        for turn in 0..n_turns {
            let (user, output, think) = match kind {
                SessionKind::Chat => (
                    uniform(&mut rng, 32, 768),
                    uniform(&mut rng, 16, 512),
                    exponential(&mut rng, 8_000.0),
                ),
                SessionKind::Agent => (
                    uniform(&mut rng, 16, 256),
                    uniform(&mut rng, 16, 128),
                    exponential(&mut rng, 1_500.0),
                ),
                SessionKind::Unique => (uniform(&mut rng, 16, 64), uniform(&mut rng, 64, 512), 0.0),
            };
            segments.push((fresh(), user));
            let input: u32 = segments.iter().map(|s| s.1).sum();
            let answer = fresh();
            turns.push(Turn {
                req: Request {
                    arrival_ms: at,
                    segments: segments.clone(),
                    input_tokens: input,
                    output_tokens: output,
                    session: Some(session),
                    output_content: answer,
                    follows: None,
                },
                session,
                turn,
                think_ms: think,
            });
            // The assistant's answer joins the conversation's context.
            segments.push((answer, output));
            at += f64::from(output) * 25.0 + think;
        }
    }
    turns.sort_by(|a, b| a.req.arrival_ms.total_cmp(&b.req.arrival_ms));
    // Link each later turn to its predecessor's index in the sorted list (a session's
    // turns stay in order: each nominal arrival is after the previous one).
    let mut last: std::collections::HashMap<u64, (u32, u32)> = std::collections::HashMap::new();
    let mut requests = Vec::with_capacity(turns.len());
    for (i, t) in turns.into_iter().enumerate() {
        let mut req = t.req;
        if t.turn > 0 {
            let (prev, prev_turn) = last[&t.session];
            debug_assert_eq!(prev_turn + 1, t.turn);
            req.follows = Some((prev, t.think_ms));
        }
        last.insert(t.session, (i as u32, t.turn));
        requests.push(req);
    }
    Workload {
        name: "built-in".into(),
        requests,
        params: vec![
            ("seed", cfg.seed as f64),
            ("sessions", f64::from(cfg.sessions)),
            ("session_rate", cfg.session_rate),
            ("system_prompts", f64::from(cfg.system_prompts)),
            ("tool_preambles", f64::from(cfg.tool_preambles)),
            ("agent_share", cfg.agent_share),
            ("unique_share", cfg.unique_share),
        ],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_trace(name: &str, body: &str) -> std::path::PathBuf {
        let p = std::env::temp_dir().join(format!("kvr-wl-{}-{name}", std::process::id()));
        std::fs::write(&p, body).unwrap();
        p
    }

    #[test]
    fn mooncake_ids_become_shared_token_prefixes() {
        let p = write_trace(
            "ok.jsonl",
            "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 5, \"hash_ids\": [7, 8]}\n\
             \n\
             {\"timestamp\": 3, \"input_length\": 1100, \"output_length\": 5, \"hash_ids\": [7, 8, 9], \"extra\": 1}\n",
        );
        let w = load_mooncake(&p).unwrap();
        assert_eq!(w.requests.len(), 2);
        let (mut a, mut b) = (Vec::new(), Vec::new());
        w.requests[0].tokens_into(&mut a);
        w.requests[1].tokens_into(&mut b);
        assert_eq!((a.len(), b.len()), (600, 1100));
        // The first request's partial chunk 8 is the start of the second's full chunk 8.
        assert_eq!(a[..], b[..600]);
        assert_ne!(a[..512], a[88..600], "content differs by position");
        std::fs::remove_file(p).ok();
    }

    #[test]
    fn malformed_lines_name_their_number_and_problem() {
        let cases = [
            ("{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 5, \"hash_ids\": [1]}", ":1: 1 hash_ids"),
            ("{\"timestamp\": 0, \"input_length\": 0, \"output_length\": 5, \"hash_ids\": []}", ":1: input_length is 0"),
            ("{\"timestamp\": -1, \"input_length\": 1, \"output_length\": 5, \"hash_ids\": [1]}", ":1: timestamp"),
            ("{\"timestamp\": 0, \"input_length\": 1}", ":1: not a trace record"),
            ("not json", ":1: not a trace record"),
            ("{\"timestamp\": 5, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [1]}\n{\"timestamp\": 4, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [1]}", ":2: timestamp 4 is earlier"),
        ];
        for (i, (body, want)) in cases.iter().enumerate() {
            let p = write_trace(&format!("bad{i}.jsonl"), body);
            let err = load_mooncake(&p).unwrap_err();
            assert!(err.contains(want), "{err:?} should contain {want:?}");
            std::fs::remove_file(p).ok();
        }
        let p = write_trace("empty.jsonl", "\n\n");
        assert!(load_mooncake(&p).unwrap_err().contains("no requests"));
        std::fs::remove_file(p).ok();
        assert!(load_mooncake(Path::new("/nonexistent/trace.jsonl")).is_err());
    }

    #[test]
    fn generator_is_deterministic_sorted_and_shares_prefixes() {
        let cfg = GeneratorConfig {
            sessions: 50,
            ..GeneratorConfig::default()
        };
        let a = generate(&cfg);
        let b = generate(&cfg);
        assert_eq!(a.requests, b.requests);
        assert!(a
            .requests
            .windows(2)
            .all(|w| w[0].arrival_ms <= w[1].arrival_ms));
        let c = generate(&GeneratorConfig { seed: 7, ..cfg });
        assert_ne!(a.requests, c.requests);
        // A later turn of a session extends the earlier turn's prompt.
        let s = a.requests[0].session;
        let turns: Vec<_> = a.requests.iter().filter(|r| r.session == s).collect();
        if turns.len() > 1 {
            let (mut x, mut y) = (Vec::new(), Vec::new());
            turns[0].tokens_into(&mut x);
            turns[1].tokens_into(&mut y);
            assert_eq!(x[..], y[..x.len()]);
        }
        for r in &a.requests {
            assert_eq!(r.input_tokens, r.segments.iter().map(|s| s.1).sum::<u32>());
        }
    }
}
