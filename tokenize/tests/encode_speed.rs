//! Encode time on the test asset for 1k-, 8k- and 32k-token prompts. A measurement, not a
//! test of a threshold; run it with
//! `cargo test -p kvr-tokenize --release --locked --test encode_speed -- --ignored --nocapture`.
//!
//! Each figure is the median of 21 runs (after a first, reported apart), as wall time and
//! as the thread's time on a CPU (`CLOCK_THREAD_CPUTIME_ID`): on a busy
//! machine a run longer than a scheduler slice is preempted, and only the latter shows
//! the work itself.

mod common;

use std::time::{Duration, Instant};

use kvr_tokenize::{ChatMessage, ReuseConfig, Tokenizer};

const WORDS: &[&str] = &[
    "the",
    "cache",
    "request",
    "worker",
    "prefix",
    "block",
    "token",
    "routing",
    "engine",
    "model",
    "score",
    "of",
    "and",
    "a",
    "to",
    "in",
    "is",
    "that",
    "with",
    "for",
    "each",
    "KV",
    "events",
    "index",
    "selection",
    "overlap",
    "load",
    "decode",
    "prefill",
    "server",
    "latency",
    "queue",
    "batch",
    "hash",
    "tree",
    "memory",
    "GPU",
    "answer",
    "question",
    "because",
    "when",
    "which",
    "returns",
    "holds",
    "longest",
    "matching",
    "sequence,",
    "(for",
    "example)",
    "1024",
    "3.5",
    "x",
    "y=2;",
    "fn",
    "main()",
    "{",
    "}",
    "\n",
    "\n\n",
];

/// Text of exactly `target` tokens (without BOS): pseudo-random words from `WORDS`, with
/// one in eight an identifier of random letters (so not every word is in the BPE cache).
/// Words add up: the byte-level pre-tokenizer splits before each space.
fn text_of(tok: &Tokenizer, target: usize, seed: u64) -> String {
    let mut rng = seed;
    let mut next = || {
        rng = rng
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        rng >> 33
    };
    let mut text = String::new();
    let mut count = 0;
    while count < target {
        let word = if next() % 8 == 0 {
            (0..3 + next() % 8)
                .map(|_| (b'a' + (next() % 26) as u8) as char)
                .collect()
        } else {
            WORDS[next() as usize % WORDS.len()].to_owned()
        };
        let piece = if text.is_empty() || word.starts_with('\n') {
            word
        } else {
            format!(" {word}")
        };
        let n = tok.encode_plain(&piece).unwrap().len();
        if count + n > target {
            continue;
        }
        text.push_str(&piece);
        count += n;
    }
    text
}

fn median(mut d: Vec<Duration>) -> Duration {
    d.sort();
    d[d.len() / 2]
}

/// The calling thread's time on a CPU so far.
fn cpu_time() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec for the duration of the call.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID)");
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// (first run's wall time, median wall time, median CPU time) of `runs` runs of `f`.
fn time(runs: usize, mut f: impl FnMut()) -> (Duration, Duration, Duration) {
    let start = Instant::now();
    f();
    let first = start.elapsed();
    let (wall, cpu) = (0..runs)
        .map(|_| {
            let (s, c) = (Instant::now(), cpu_time());
            f();
            (s.elapsed(), cpu_time().saturating_sub(c))
        })
        .unzip();
    (first, median(wall), median(cpu))
}

#[test]
#[ignore = "a measurement: run with --ignored --nocapture"]
fn encode_speed() {
    let tok = common::asset();
    println!(
        "| what | bytes | first run (wall) | median (wall) | median (on CPU) | tokens/s (on CPU) |"
    );
    println!("|---|---|---|---|---|---|");
    for (i, target) in [1024usize, 8192, 32768].into_iter().enumerate() {
        let text = text_of(&tok, target, 17 + i as u64);
        let mut n = 0;
        let (first, wall, cpu) = time(21, || {
            n = tok.encode(std::hint::black_box(&text)).unwrap().len()
        });
        assert_eq!(n, target + 1, "the text has {target} tokens, plus BOS");
        println!(
            "| encode {target} tokens | {} | {first:.2?} | {wall:.2?} | {cpu:.2?} | {:.2} M |",
            text.len(),
            target as f64 / cpu.as_secs_f64() / 1e6
        );
    }
    let text = text_of(&tok, 32768, 99);
    let chat = [
        ChatMessage::new("system", "You are terse."),
        ChatMessage::new("user", text.clone()),
    ];
    let (first, wall, cpu) = time(21, || {
        std::hint::black_box(tok.encode_chat(&chat).unwrap());
    });
    let len = text.len();
    println!("| encode_chat 32768 tokens (render + encode) | {len} | {first:.2?} | {wall:.2?} | {cpu:.2?} | |");
    let (first, wall, cpu) = time(21, || {
        std::hint::black_box(tok.render_chat(&chat).unwrap());
    });
    println!("| render_chat 32768 tokens (template only) | {len} | {first:.2?} | {wall:.2?} | {cpu:.2?} | |");
    let ids: Vec<u32> = (0..32768).map(|i| i % 2048).collect();
    let body = format!(
        r#"{{"model": "m", "prompt": {}}}"#,
        serde_json::to_string(&ids).unwrap()
    );
    let (first, wall, cpu) = time(21, || {
        std::hint::black_box(
            kvr_tokenize::parse_openai("/v1/completions", body.as_bytes()).unwrap(),
        );
    });
    let len = body.len();
    println!("| parse_openai, 32768 token ids | {len} | {first:.2?} | {wall:.2?} | {cpu:.2?} | |");
    conversation_rows();
}

/// A conversation of 16 turns (~8k tokens) whose history is resent with a new reply and
/// question (~500 tokens): its encoding with and without token reuse, each run a new last
/// turn (so only the history is seen before; reuse's first checked uses are run before);
/// and a text never seen, with reuse on.
fn conversation_rows() {
    let plain = common::asset();
    let reuse = common::asset().with_reuse(ReuseConfig::default());
    let mut history = vec![ChatMessage::new("system", text_of(&plain, 200, 1))];
    for t in 0..15 {
        let role = if t % 2 == 0 { "user" } else { "assistant" };
        history.push(ChatMessage::new(role, text_of(&plain, 500, 100 + t)));
    }
    let turns: Vec<Vec<ChatMessage>> = (0..60)
        .map(|i| {
            let mut h = history.clone();
            h.push(ChatMessage::new("assistant", text_of(&plain, 250, 500 + i)));
            h.push(ChatMessage::new("user", text_of(&plain, 250, 900 + i)));
            h
        })
        .collect();
    let tokens = plain.encode_chat(&turns[0]).unwrap().len();
    let bytes = plain.render_chat(&turns[0]).unwrap().len();
    // The history as the previous turn sent it.
    let mut previous = history.clone();
    previous.pop();
    reuse.encode_chat(&history).unwrap();
    // Past the first reuses, each checked against a full encoding (then one in 256).
    for t in &turns[..ReuseConfig::default().check_first as usize] {
        reuse.encode_chat(t).unwrap();
    }
    for (name, tok) in [("without reuse", &plain), ("with reuse", &reuse)] {
        let mut i = 32;
        let (first, wall, cpu) = time(21, || {
            let ids = tok.encode_chat(&turns[i % turns.len()]).unwrap();
            assert!(ids.len() > tokens / 2);
            i += 1;
        });
        println!("| encode_chat {tokens} tokens, a new last turn, {name} | {bytes} | {first:.2?} | {wall:.2?} | {cpu:.2?} | |");
    }
    let s = reuse.reuse_stats().unwrap();
    assert!(s.hits >= 21 && s.mismatches == 0, "{s:?}");
    let texts: Vec<String> = (0..44).map(|i| text_of(&plain, 8192, 7000 + i)).collect();
    for (name, tok, at) in [
        ("with reuse (misses)", &reuse, 0),
        ("without reuse", &plain, 22),
    ] {
        let mut i = at;
        let (first, wall, cpu) = time(21, || {
            std::hint::black_box(tok.encode(&texts[i]).unwrap());
            i += 1;
        });
        println!(
            "| encode 8192 tokens never seen, {name} | | {first:.2?} | {wall:.2?} | {cpu:.2?} | |"
        );
    }
}
