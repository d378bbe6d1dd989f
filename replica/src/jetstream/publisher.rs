//! Publishing this replica's booking events to the stream: the booking path only enqueues
//! (never waits); one task publishes them in order, one at a time, waiting for each
//! acknowledgement and retrying until the stream has it. Each message carries
//! `Nats-Msg-Id: <name>-<incarnation>-<seq>`, so a retried publish the server had stored
//! already is dropped by its duplicate window rather than stored twice.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::mpsc;

use super::stats::JsCounters;

/// One event, encoded, waiting to be published.
#[derive(Debug)]
pub(crate) struct Outgoing {
    pub(crate) msg_id: String,
    pub(crate) payload: Bytes,
}

/// The longest wait between two attempts at one publish.
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// Publishes what `queue` holds to `subject`, in order, until the queue closes.
pub(crate) async fn run(
    js: async_nats::jetstream::Context,
    subject: String,
    mut queue: mpsc::Receiver<Outgoing>,
    counters: Arc<JsCounters>,
) {
    let mut failing = false;
    while let Some(out) = queue.recv().await {
        counters.queued.fetch_sub(1, Ordering::Relaxed);
        let mut backoff = Duration::from_millis(50);
        loop {
            match publish_once(&js, &subject, &out).await {
                Ok(duplicate) => {
                    counters.acked.fetch_add(1, Ordering::Relaxed);
                    if duplicate {
                        counters.deduplicated.fetch_add(1, Ordering::Relaxed);
                    }
                    if failing {
                        failing = false;
                        tracing::info!(subject, "replica sync (jetstream): publishing again");
                    }
                    break;
                }
                Err(e) => {
                    counters.publish_retries.fetch_add(1, Ordering::Relaxed);
                    if !failing {
                        failing = true;
                        tracing::warn!(
                            subject,
                            "replica sync (jetstream): publishing paused, events queue until the stream answers: {e}"
                        );
                    }
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
    }
}

/// One attempt: `Ok(true)` when the stream had the message already.
async fn publish_once(
    js: &async_nats::jetstream::Context,
    subject: &str,
    out: &Outgoing,
) -> Result<bool, String> {
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", out.msg_id.as_str());
    let ack = js
        .publish_with_headers(subject.to_string(), headers, out.payload.clone())
        .await
        .map_err(|e| e.to_string())?;
    let ack = ack.await.map_err(|e| e.to_string())?;
    Ok(ack.duplicate)
}
