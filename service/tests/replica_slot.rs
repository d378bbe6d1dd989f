//! `--replica-ordinal` / `--replica-count` in `kvr serve`: four replicas that each book
//! three requests at the same instant (none sees another's bookings) fill four idle
//! workers evenly, because each splits ties from its own place; the flags are checked.

use clap::Parser;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: kvr_service::ServeArgs,
}

fn app(extra: &[&str]) -> Result<std::sync::Arc<kvr_service::App>, String> {
    let mut argv = vec!["kvr-serve", "--router-use-kv-events", "false"];
    argv.extend_from_slice(extra);
    let app = kvr_service::App::new(Cli::try_parse_from(argv).map_err(|e| e.to_string())?.args)?;
    // Registered out of id order: the split follows rank ids, not registration order.
    for w in [3u64, 1, 4, 2] {
        let body = serde_json::json!({"worker_id": w, "endpoint": "http://w", "block_size": 16});
        app.registry
            .upsert(serde_json::from_value(body).unwrap())
            .expect("upsert");
    }
    Ok(app)
}

/// Each of `replicas` books three prompts; the bookings per worker id 1..=4.
fn burst(replicas: &[std::sync::Arc<kvr_service::App>]) -> [u32; 4] {
    let mut load = [0u32; 4];
    for (r, app) in replicas.iter().enumerate() {
        for k in 0..3 {
            let tokens: Vec<u32> = (0..64).map(|t| (r * 1000 + k * 100 + t) as u32).collect();
            let body = serde_json::from_value(serde_json::json!({"token_ids": tokens})).unwrap();
            let d = app.select_and_reserve(&body).expect("select_and_reserve");
            load[d.worker_id as usize - 1] += 1;
        }
    }
    load
}

#[test]
fn four_replicas_with_their_own_ordinals_spread_a_simultaneous_burst_evenly() {
    let replicas: Vec<_> = (0..4)
        .map(|o| app(&["--replica-ordinal", &o.to_string(), "--replica-count", "4"]).unwrap())
        .collect();
    assert_eq!(burst(&replicas), [3, 3, 3, 3]);
}

#[test]
fn without_ordinals_the_same_burst_piles_up_sometimes() {
    // The control: with random tie-breaks each replica leaves out a random worker, and
    // the split is even only when all four leave out different ones (24 / 256); all of
    // 20 tries even has probability below 1e-20.
    let uneven = (0..20)
        .filter(|_| {
            let replicas: Vec<_> = (0..4).map(|_| app(&[]).unwrap()).collect();
            burst(&replicas) != [3, 3, 3, 3]
        })
        .count();
    assert!(uneven > 0, "random tie-breaks never piled up in 20 bursts");
}

#[test]
fn the_ordinal_flags_are_checked() {
    assert!(app(&["--replica-ordinal", "4", "--replica-count", "4"]).is_err());
    assert!(app(&["--replica-ordinal", "1"]).is_err());
    assert!(app(&["--replica-count", "2"]).is_err());
    assert!(app(&["--replica-ordinal", "0", "--replica-count", "1"]).is_ok());
}
