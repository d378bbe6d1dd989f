//! Subscribe to two vLLM workers' KV events and route a prompt to the one holding most of it.
use kvr::config::PartitionConfig;
use kvr::{Engine, Outcome, PartitionKey, SelectRequest, WorkerInfo};
use kvr_zmq::{subscribe, SubscribeConfig};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let engine = Engine::new();
    let key = PartitionKey::new("meta-llama/Llama-3.1-8B", "default");
    let partition = engine.create_partition(key.clone(), PartitionConfig::new(16))?;
    let mut subscriptions = Vec::new();
    for (worker_id, port) in [(1, 5557), (2, 5558)] {
        partition.upsert_worker(WorkerInfo::new(worker_id, 1))?;
        subscriptions.push(subscribe(
            partition.clone(),
            SubscribeConfig::Connect {
                endpoint: format!("tcp://127.0.0.1:{port}"), // vLLM's --kv-events-config endpoint
                replay_endpoint: None,
                topic: Vec::new(),
                worker_id,
                stream: 0,
            },
        )?);
    }
    let prompt: Vec<u32> = (0..1024).collect(); // the request's token ids
    if let Outcome::Selected(d) =
        engine.select_and_reserve(&key, &SelectRequest::tokens(&prompt))?
    {
        let id = d.selection_id.expect("booked");
        println!(
            "worker {} ({} tokens cached)",
            d.rank.worker_id, d.cached_tokens
        );
        engine.mark_prefill_complete(id)?; // when its first token is out
        engine.free(id)?; // when the request ends
    }
    Ok(())
}
