//! The listener, logging, background upkeep and graceful shutdown.

use std::future::Future;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::net::TcpListener;

use crate::args::ServeArgs;
use crate::App;

/// How often caller-named selection ids whose bookings ended unseen are forgotten.
pub const SWEEP_EVERY: Duration = Duration::from_secs(15);

/// `kvr serve`: runs until SIGINT or SIGTERM, then stops taking connections, lets
/// in-flight requests finish (up to `--shutdown-grace-secs`), and stops the KV-event
/// subscriptions.
pub fn run(args: ServeArgs) -> Result<(), String> {
    init_logging(&args.log_format);
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    if args.threads > 0 {
        rt.worker_threads(args.threads);
    }
    let rt = rt
        .enable_all()
        .build()
        .map_err(|e| format!("tokio runtime: {e}"))?;
    rt.block_on(async move {
        let addr = format!("{}:{}", args.host, args.port);
        let listener = TcpListener::bind(&addr)
            .await
            .map_err(|e| format!("listen on {addr}: {e}"))?;
        if let Some(warning) = listener
            .local_addr()
            .ok()
            .and_then(|a| exposure_warning(a.ip()))
        {
            tracing::warn!("{warning}");
        }
        let app = App::new(args)?;
        tracing::info!(%addr, "kvr serve listening");
        serve_on(listener, app, shutdown_signal()).await
    })
}

/// What listening on `ip` exposes, when it is not a loopback address: the service has no
/// authentication, so whoever reaches the port can use its write routes.
pub fn exposure_warning(ip: IpAddr) -> Option<String> {
    if ip.to_canonical().is_loopback() {
        return None;
    }
    Some(format!(
        "listening on {ip}, not a loopback address: anyone who can reach this port can \
         register and remove workers (and so choose the KV-event endpoints kvr \
         subscribes to) and book and free selections, as kvr serve has no \
         authentication; use --host 127.0.0.1, or keep the port behind a firewall or \
         an authenticating proxy"
    ))
}

/// Serves `app` on `listener` until `shutdown` resolves (tests pass their own signal).
pub async fn serve_on(
    listener: TcpListener,
    app: Arc<App>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), String> {
    crate::replica_sync::start(&app).await?;
    crate::recovery::start(app.clone());
    let sweeper = tokio::spawn(sweep_named_ids(app.clone()));
    let health_log = tokio::spawn(log_source_health(app.clone()));
    let grace = Duration::from_secs(app.args.shutdown_grace_secs);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let router = crate::routes::router(app.clone());
    let server = crate::conn::serve_connections(
        listener,
        router,
        app.args.conn_limits(),
        app.metrics.refusals.clone(),
        stop_rx,
    );
    let mut server = tokio::spawn(server);
    tokio::select! {
        r = &mut server => {
            sweeper.abort();
            health_log.abort();
            app.registry.stop_all();
            return r.map_err(|e| e.to_string());
        }
        () = shutdown => {}
    }
    tracing::info!(
        grace_secs = grace.as_secs(),
        "shutting down: draining requests"
    );
    let _ = stop_tx.send(true);
    let drained = tokio::time::timeout(grace, &mut server).await.is_ok();
    if !drained {
        tracing::warn!("requests still in flight after the grace period: stopping anyway");
        server.abort();
    }
    sweeper.abort();
    health_log.abort();
    app.registry.stop_all();
    if let Some(sync) = app.replicas.jetstream() {
        // The last frees reach the stream, or the peers keep those bookings until this
        // replica's next incarnation, its silence bound, or their lifetime.
        let flushed = sync.flush(REPLICA_FLUSH).await;
        tracing::info!(flushed, "replica sync (jetstream): stopped");
        sync.close();
    }
    if let Some(state) = &app.state {
        state.close();
        tracing::info!("state: final snapshots written");
    }
    tracing::info!("KV-event subscriptions stopped; bye");
    Ok(())
}

/// The longest a graceful stop waits for the JetStream sync's queued events.
pub const REPLICA_FLUSH: Duration = Duration::from_secs(3);

/// How often the KV-event streams' health is checked for the log.
pub const HEALTH_LOG_EVERY: Duration = Duration::from_secs(1);

/// Logs each KV-event stream's change of state, once per change (`sources::HealthLog`).
async fn log_source_health(app: Arc<App>) {
    let mut log = crate::sources::HealthLog::default();
    let mut tick = tokio::time::interval(HEALTH_LOG_EVERY);
    loop {
        tick.tick().await;
        log.log_changes(&app);
    }
}

async fn sweep_named_ids(app: Arc<App>) {
    let mut tick = tokio::time::interval(SWEEP_EVERY);
    loop {
        tick.tick().await;
        app.sweep_named_ids();
    }
}

impl App {
    /// Forgets the caller-named selection ids whose bookings ended unseen (expiry, a
    /// worker leaving); hosts call it every [`SWEEP_EVERY`]. Returns how many went.
    pub fn sweep_named_ids(&self) -> usize {
        let gone = self.ids.sweep(Instant::now(), |id, key| {
            self.registry
                .partition(key)
                .is_some_and(|e| e.partition.bookings().contains(id))
        });
        if gone > 0 {
            tracing::debug!(gone, "forgot caller-named ids of ended bookings");
        }
        gone
    }
}

/// Resolves at SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}

/// Structured logs to stderr (`--log-format json`), filtered by `KVR_LOG` or `RUST_LOG`.
pub fn init_logging(format: &str) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_env("KVR_LOG")
        .or_else(|_| EnvFilter::try_from_default_env())
        .unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = if format == "json" {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
}

#[cfg(test)]
mod tests {
    use super::exposure_warning;

    #[test]
    fn loopback_binds_are_quiet_and_wider_binds_warn() {
        for quiet in ["127.0.0.1", "127.0.0.2", "::1", "::ffff:127.0.0.1"] {
            assert_eq!(exposure_warning(quiet.parse().unwrap()), None, "{quiet}");
        }
        for loud in ["0.0.0.0", "::", "10.1.2.3", "192.168.0.5"] {
            let w = exposure_warning(loud.parse().unwrap()).expect(loud);
            assert!(w.contains("register and remove workers"), "{w}");
        }
    }
}
