//! The token-array readers alone, side by side on the same prompts: kvr's hand-read JSON
//! `token_ids`, serde_json's `Vec<u32>`, and the msgpack form (array and `bin`). Plain
//! timing: each reader runs the same body many times; the median of 15 rounds, with
//! min–max, in ns per token and GB/s of body. `cargo bench -p kvr-service --bench
//! token_parse` (add `-- 32768` for one size).

use std::hint::black_box;
use std::time::Instant;

use kvr_service::fuzzing::{msgpack_tokens, split_tokens};

/// Token ids as a tokenizer gives them: below a 32k or a 200k vocabulary.
fn tokens(n: usize, vocab: u32, seed: u64) -> Vec<u32> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x = kvr::hash::splitmix64(x);
            (x % u64::from(vocab)) as u32
        })
        .collect()
}

fn json(t: &[u32]) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({"model_name": "m", "token_ids": t})).unwrap()
}

fn msgpack(t: &[u32], bin: bool) -> Vec<u8> {
    use rmp::encode as en;
    let mut b = Vec::new();
    en::write_map_len(&mut b, 2).unwrap();
    en::write_str(&mut b, "model_name").unwrap();
    en::write_str(&mut b, "m").unwrap();
    en::write_str(&mut b, "token_ids").unwrap();
    if bin {
        let le: Vec<u8> = t.iter().flat_map(|x| x.to_le_bytes()).collect();
        en::write_bin(&mut b, &le).unwrap();
    } else {
        en::write_array_len(&mut b, t.len() as u32).unwrap();
        for &x in t {
            en::write_uint(&mut b, u64::from(x)).unwrap();
        }
    }
    b
}

/// A reader: the body in, the number of tokens read out.
type Reader<'a> = (&'static str, &'a [u8], &'a dyn Fn(&[u8]) -> usize);

#[derive(serde::Deserialize)]
struct Serde {
    token_ids: Vec<u32>,
}

/// Median (min, max) ns per call of `f` over 15 rounds of enough calls for ~20 ms.
fn time(mut f: impl FnMut() -> usize) -> (f64, f64, f64) {
    let start = Instant::now();
    let mut calls = 0u32;
    while start.elapsed().as_millis() < 20 {
        black_box(f());
        calls += 1;
    }
    let mut rounds: Vec<f64> = (0..15)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..calls {
                black_box(f());
            }
            t.elapsed().as_nanos() as f64 / f64::from(calls)
        })
        .collect();
    rounds.sort_by(f64::total_cmp);
    (rounds[7], rounds[0], rounds[14])
}

fn main() {
    let sizes: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let sizes = if sizes.is_empty() {
        vec![1024, 8192, 32768]
    } else {
        sizes
    };
    println!("| tokens | vocab | reader | body KiB | ns/token | GB/s |");
    println!("|---|---|---|---|---|---|");
    for &n in &sizes {
        for vocab in [32_000, 200_000] {
            let t = tokens(n, vocab, n as u64);
            let j = json(&t);
            assert_eq!(split_tokens(&j).as_deref(), Some(&t[..]));
            let ma = msgpack(&t, false);
            let mb = msgpack(&t, true);
            assert_eq!(msgpack_tokens(&ma).as_deref(), Some(&t[..]));
            assert_eq!(msgpack_tokens(&mb).as_deref(), Some(&t[..]));
            let readers: [Reader<'_>; 4] = [
                ("json, by hand", &j, &|b| {
                    split_tokens(b).map_or(0, |v| v.len())
                }),
                ("json, serde_json", &j, &|b| {
                    serde_json::from_slice::<Serde>(b).map_or(0, |s| s.token_ids.len())
                }),
                ("msgpack array", &ma, &|b| {
                    msgpack_tokens(b).map_or(0, |v| v.len())
                }),
                ("msgpack bin", &mb, &|b| {
                    msgpack_tokens(b).map_or(0, |v| v.len())
                }),
            ];
            for (name, body, read) in readers {
                let (med, lo, hi) = time(|| read(black_box(body)));
                println!(
                    "| {n} | {vocab} | {name} | {:.0} | {:.2} ({:.2}–{:.2}) | {:.2} |",
                    body.len() as f64 / 1024.0,
                    med / n as f64,
                    lo / n as f64,
                    hi / n as f64,
                    body.len() as f64 / med,
                );
            }
        }
    }
}
