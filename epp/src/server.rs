//! The gRPC server (ext_proc and health), the selection service's HTTP API beside it, the
//! membership watcher, readiness, and graceful shutdown.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tokio_stream::StreamExt;
use tonic::{Request, Response, Status, Streaming};
use tonic_health::ServingStatus;

use kvr_service::App;

use crate::args::EppArgs;
use crate::exchange::{Exchange, Shared};
use crate::pool::{self, PoolFile};

/// The gRPC service name Envoy's health check and the protocol name.
pub const EXT_PROC_SERVICE: &str = "envoy.service.ext_proc.v3.ExternalProcessor";

/// The ext_proc service: one [`Exchange`] per stream.
#[derive(Debug, Clone)]
pub struct EppService {
    shared: Shared,
}

type ResponseStream =
    Pin<Box<dyn tokio_stream::Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for EppService {
    type ProcessStream = ResponseStream;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel::<Result<ProcessingResponse, Status>>(16);
        let mut exchange = Exchange::new(self.shared.clone());
        tokio::spawn(async move {
            // The exchange lives as long as the stream: when Envoy ends it (the response
            // done, a reset, a disconnect), it is dropped here and frees a live booking.
            while let Some(msg) = inbound.next().await {
                let Ok(msg) = msg else { break };
                for out in exchange.handle(msg) {
                    if tx.send(Ok(out)).await.is_err() {
                        return;
                    }
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// `kvr epp`: runs until SIGINT or SIGTERM.
pub fn run(args: EppArgs) -> Result<(), String> {
    kvr_service::server::init_logging(&args.serve.log_format);
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    if args.serve.threads > 0 {
        rt.worker_threads(args.serve.threads);
    }
    let rt = rt
        .enable_all()
        .build()
        .map_err(|e| format!("tokio runtime: {e}"))?;
    rt.block_on(async move {
        let grpc_addr = format!("{}:{}", args.grpc_host, args.grpc_port);
        let grpc = TcpListener::bind(&grpc_addr)
            .await
            .map_err(|e| format!("listen on {grpc_addr}: {e}"))?;
        let http_addr = format!("{}:{}", args.serve.host, args.serve.port);
        let http = TcpListener::bind(&http_addr)
            .await
            .map_err(|e| format!("listen on {http_addr}: {e}"))?;
        for l in [&grpc, &http] {
            if let Some(w) = l
                .local_addr()
                .ok()
                .and_then(|a| kvr_service::server::exposure_warning(a.ip()))
            {
                tracing::warn!("{w}");
            }
        }
        tracing::info!(%grpc_addr, %http_addr, "kvr epp listening");
        serve_with(args, grpc, http, kvr_service::server::shutdown_signal()).await
    })
}

/// Serves on the given listeners until `shutdown` resolves (tests pass their own).
pub async fn serve_with(
    args: EppArgs,
    grpc: TcpListener,
    http: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), String> {
    let text = std::fs::read_to_string(&args.pool)
        .map_err(|e| format!("pool file {}: {e}", args.pool.display()))?;
    let membership = PoolFile::parse(&text)?.membership();
    let shared = Shared::new(&args, &membership)?;
    let (app, picker, metrics) = (
        shared.picker.app.clone(),
        shared.picker.clone(),
        shared.metrics.clone(),
    );
    let watcher = {
        let (p, m) = (picker.clone(), metrics.clone());
        tokio::spawn(pool::watch(
            app.clone(),
            args.pool.clone(),
            Duration::from_millis(args.pool_poll_ms.max(10)),
            membership,
            move |next| p.set_pool(next),
            move |_| {
                m.pool_errors.inc();
            },
        ))
    };
    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_service_status("liveness", ServingStatus::Serving)
        .await;
    let readiness = tokio::spawn(track_readiness(
        app.clone(),
        health.clone(),
        Duration::from_millis(args.readiness_poll_ms.max(10)),
    ));
    let (stop_tx, stop_rx) = watch::channel(false);
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let http_task = tokio::spawn(kvr_service::serve_on(
        http,
        app.clone(),
        stopped(stop_rx.clone()),
    ));
    let grpc_task = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(health_service)
            .add_service(ExternalProcessorServer::new(EppService { shared }))
            .serve_with_incoming_shutdown(no_nagle(TcpListenerStream::new(grpc)), stopped(stop_rx)),
    );
    shutdown.await;
    tracing::info!("shutting down: not ready, draining streams");
    readiness.abort();
    health
        .set_service_status("", ServingStatus::NotServing)
        .await;
    health
        .set_service_status("readiness", ServingStatus::NotServing)
        .await;
    health
        .set_service_status(EXT_PROC_SERVICE, ServingStatus::NotServing)
        .await;
    watcher.abort();
    // Streams still arrive until the gateway's health check sees the change.
    tokio::time::sleep(Duration::from_millis(args.drain_ms)).await;
    let _ = stop_tx.send(true);
    let grace = Duration::from_secs(args.serve.shutdown_grace_secs);
    let (g, h) = tokio::join!(
        tokio::time::timeout(grace, grpc_task),
        tokio::time::timeout(grace, http_task)
    );
    if g.is_err() || h.is_err() {
        tracing::warn!("streams still open after the grace period: stopping anyway");
    }
    Ok(())
}

/// Ready (`readiness`, the ext_proc service and the overall status) while the selection
/// service is ready and no pod's KV-event stream is dead: a picker that cannot see a
/// pod's cache would route blind to it.
async fn track_readiness(
    app: Arc<App>,
    health: tonic_health::server::HealthReporter,
    every: Duration,
) {
    let mut tick = tokio::time::interval(every);
    let mut last = None;
    loop {
        tick.tick().await;
        let r = app.ready();
        let ready = r.ready && r.kv_event_sources.iter().all(|s| s.state != "dead");
        if last == Some(ready) {
            continue;
        }
        last = Some(ready);
        let status = if ready {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        for name in ["readiness", EXT_PROC_SERVICE, ""] {
            health.set_service_status(name, status).await;
        }
        tracing::info!(ready, "readiness changed");
    }
}

/// The accepted gRPC connections with Nagle's algorithm off (tonic's own `tcp_nodelay`
/// applies only to listeners it binds). With it on, a small answer waits for the
/// gateway's delayed ACK: about 40 ms added to every request on an idle connection.
fn no_nagle(
    incoming: TcpListenerStream,
) -> impl tokio_stream::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    use tokio_stream::StreamExt;
    incoming.map(|conn| {
        if let Ok(c) = &conn {
            let _ = c.set_nodelay(true);
        }
        conn
    })
}
