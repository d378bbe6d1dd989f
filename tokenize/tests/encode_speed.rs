//! Encode time on the test asset for 1k-, 8k- and 32k-token prompts. A measurement, not a
//! test of a threshold; run it with
//! `cargo test -p kvr-tokenize --release --locked --test encode_speed -- --ignored --nocapture`.

mod common;

use std::time::{Duration, Instant};

use kvr_tokenize::{ChatMessage, Tokenizer};

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

fn time(runs: usize, mut f: impl FnMut()) -> (Duration, Duration) {
    let start = Instant::now();
    f();
    let first = start.elapsed();
    let d = (0..runs)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed()
        })
        .collect();
    (first, median(d))
}

#[test]
#[ignore = "a measurement: run with --ignored --nocapture"]
fn encode_speed() {
    let tok = common::asset();
    println!("| prompt | bytes | first run | median of 21 | tokens/s (median) |");
    println!("|---|---|---|---|---|");
    for (i, target) in [1024usize, 8192, 32768].into_iter().enumerate() {
        let text = text_of(&tok, target, 17 + i as u64);
        if let Some(dir) = std::env::var_os("PROBE_DUMP") {
            std::fs::write(
                std::path::Path::new(&dir).join(format!("{target}.txt")),
                &text,
            )
            .unwrap();
        }
        let mut n = 0;
        let (first, med) = time(21, || {
            n = tok.encode(std::hint::black_box(&text)).unwrap().len()
        });
        assert_eq!(n, target + 1, "the text has {target} tokens, plus BOS");
        println!(
            "| encode {target} | {} | {first:.2?} | {med:.2?} | {:.1} M |",
            text.len(),
            target as f64 / med.as_secs_f64() / 1e6
        );
    }
    let text = text_of(&tok, 32768, 99);
    let chat = [
        ChatMessage::new("system", "You are terse."),
        ChatMessage::new("user", text.clone()),
    ];
    let (first, med) = time(21, || {
        std::hint::black_box(tok.encode_chat(&chat).unwrap());
    });
    println!(
        "| encode_chat 32768 (render + encode) | {} | {first:.2?} | {med:.2?} | |",
        text.len()
    );
    let (first, med) = time(21, || {
        std::hint::black_box(tok.render_chat(&chat).unwrap());
    });
    println!(
        "| render_chat 32768 (template only) | {} | {first:.2?} | {med:.2?} | |",
        text.len()
    );
    let ids: Vec<u32> = (0..32768).map(|i| i % 2048).collect();
    let body = format!(
        r#"{{"model": "m", "prompt": {}}}"#,
        serde_json::to_string(&ids).unwrap()
    );
    let (first, med) = time(21, || {
        std::hint::black_box(
            kvr_tokenize::parse_openai("/v1/completions", body.as_bytes()).unwrap(),
        );
    });
    println!(
        "| parse_openai 32768 token ids | {} | {first:.2?} | {med:.2?} | |",
        body.len()
    );
}
