//! The native core of `kvr.SelectionService`: kvr-service's `App` (what `kvr serve` runs)
//! with its operations called directly, dicts in and out through serde (pythonize), so
//! every answer and error is the HTTP service's by construction. The Python class in
//! kvr/__init__.py adds Dynamo's async surface on top.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use clap::Parser;
use kvr_service::error::{ApiError, WireBody};
use kvr_service::wire::select::{ReservationRequest, SelectRequest};
use kvr_service::wire::worker::{PartitionFilter, WorkerPatch, WorkerRequest};
use kvr_service::{App, ServeArgs};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyInt, PyList};
use serde::Serialize;

use crate::errors::{api_error, service_error};

/// The service's flags from the constructor's arguments (and, as `kvr serve` and
/// Dynamo's class read them, the `DYN_ROUTER_*` environment).
#[derive(Parser, Debug)]
#[command(name = "kvr.SelectionService", no_binary_name = true)]
struct Flags {
    #[command(flatten)]
    args: ServeArgs,
}

/// A request dict as the service's body type `T`: through its fast form first (as the
/// HTTP service reads bodies), and only for a dict that fails through `T` itself, whose
/// error text is the one Dynamo's class gives (it converts with serde too).
fn body<T: WireBody>(obj: &Bound<'_, PyAny>) -> PyResult<T> {
    if let Some(fast) = with_tokens_by_hand::<T>(obj) {
        return Ok(fast.into());
    }
    if let Ok(fast) = pythonize::depythonize::<T::Fast>(obj) {
        return Ok(fast.into());
    }
    pythonize::depythonize::<T>(obj).map_err(|e| PyValueError::new_err(dynamo_text(&e.to_string())))
}

/// A prompt body's `token_ids` list read directly (serde through pythonize visits each
/// int as a generic value, most of the call at 8k tokens), the rest through serde; `None`
/// for anything unusual (the general path then reads it, or words its error).
fn with_tokens_by_hand<T: WireBody>(obj: &Bound<'_, PyAny>) -> Option<T::Fast> {
    let slot = T::TOKEN_SLOT?;
    let d = obj.cast::<PyDict>().ok()?;
    let tokens = crate::tokens::from_list(&d.get_item("token_ids").ok()??)?;
    let rest = d.copy().ok()?;
    rest.del_item("token_ids").ok()?;
    let mut fast = pythonize::depythonize::<T::Fast>(rest.as_any()).ok()?;
    *slot(&mut fast) = Some(tokens);
    Some(fast)
}

/// pyo3 0.27 words a failed cast "cannot be cast as 'str'"; Dynamo 1.6.1's pyo3 said
/// "cannot be converted to 'PyString'": the same error in Dynamo's words.
fn dynamo_text(s: &str) -> String {
    s.replace(
        "cannot be cast as 'str'",
        "cannot be converted to 'PyString'",
    )
    .replace("cannot be cast as", "cannot be converted to")
}

/// Any serde value (the service's answers) as Python objects.
fn to_py<T: Serialize>(py: Python<'_>, v: &T) -> PyResult<Py<PyAny>> {
    pythonize::pythonize(py, v)
        .map(Bound::unbind)
        .map_err(|e| PyValueError::new_err(e.to_string()))
}

/// Dynamo's class keys a worker's `kv_events_endpoints` by int rank (JSON, by string):
/// a worker dict's int keys become the strings the service's type reads (string keys are
/// taken too).
fn worker_in<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    let Ok(d) = obj.cast::<PyDict>() else {
        return Ok(obj.clone());
    };
    let Some(eps) = d.get_item("kv_events_endpoints")? else {
        return Ok(obj.clone());
    };
    let Ok(eps) = eps.cast::<PyDict>() else {
        return Ok(obj.clone());
    };
    let py = obj.py();
    let keyed = PyDict::new(py);
    for (k, v) in eps.iter() {
        let k = if k.is_instance_of::<PyInt>() {
            k.str()?.into_any()
        } else {
            k
        };
        keyed.set_item(k, v)?;
    }
    let out = d.copy()?;
    out.set_item("kv_events_endpoints", keyed)?;
    Ok(out.into_any())
}

/// A worker record as Dynamo's class answers it: `kv_events_endpoints` keyed by int rank.
fn record_out(py: Python<'_>, record: &Bound<'_, PyAny>) -> PyResult<()> {
    let Ok(d) = record.cast::<PyDict>() else {
        return Ok(());
    };
    let Some(eps) = d.get_item("kv_events_endpoints")? else {
        return Ok(());
    };
    let Ok(eps) = eps.cast::<PyDict>() else {
        return Ok(());
    };
    let keyed = PyDict::new(py);
    for (k, v) in eps.iter() {
        match k
            .extract::<String>()
            .ok()
            .and_then(|s| s.parse::<u64>().ok())
        {
            Some(n) => keyed.set_item(n, v)?,
            None => keyed.set_item(k, v)?,
        }
    }
    d.set_item("kv_events_endpoints", keyed)
}

/// Records (one, a list, or `ready()`'s body with its `workers`) converted for Python,
/// their endpoints keyed as Dynamo's class keys them.
fn records_to_py<T: Serialize>(py: Python<'_>, v: &T) -> PyResult<Py<PyAny>> {
    let out = pythonize::pythonize(py, v).map_err(|e| PyValueError::new_err(e.to_string()))?;
    let list = match out.cast::<PyDict>() {
        Ok(d) if d.contains("workers")? => d.get_item("workers")?,
        Ok(_) => {
            record_out(py, &out)?;
            None
        }
        Err(_) => Some(out.clone()),
    };
    if let Some(list) = list {
        if let Ok(list) = list.cast::<PyList>() {
            for r in list.iter() {
                record_out(py, &r)?;
            }
        }
    }
    Ok(out.unbind())
}

/// The named-id sweeper's thread and its stop signal.
struct Sweeper {
    stop: Arc<(Mutex<bool>, Condvar)>,
    thread: Option<JoinHandle<()>>,
}

impl Sweeper {
    fn start(app: Arc<App>) -> Self {
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let s = stop.clone();
        let thread = std::thread::Builder::new()
            .name("kvr-sweep".into())
            .spawn(move || {
                let (lock, cv) = &*s;
                let mut stopped = lock.lock().unwrap_or_else(|e| e.into_inner());
                while !*stopped {
                    let (g, timeout) = cv
                        .wait_timeout(stopped, kvr_service::server::SWEEP_EVERY)
                        .unwrap_or_else(|e| e.into_inner());
                    stopped = g;
                    if timeout.timed_out() && !*stopped {
                        app.sweep_named_ids();
                    }
                }
            })
            .ok();
        Self { stop, thread }
    }

    fn stop(&mut self) {
        let (lock, cv) = &*self.stop;
        *lock.lock().unwrap_or_else(|e| e.into_inner()) = true;
        cv.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// `kvr._kvr.NativeService`: synchronous, every call releasing the GIL for its work.
#[pyclass(module = "kvr._kvr", frozen)]
pub struct NativeService {
    app: Arc<App>,
    shut: AtomicBool,
    sweeper: Mutex<Sweeper>,
    /// The replica sync's sockets run here (`replica_sync_port`); none without it.
    /// Dropped at `shutdown` (the sync's tasks stop with it).
    replica_rt: Mutex<Option<tokio::runtime::Runtime>>,
}

impl NativeService {
    /// Refuses work after `shutdown` (Dynamo's words and kind).
    fn live(&self, py: Python<'_>) -> PyResult<&App> {
        if self.shut.load(Ordering::Acquire) {
            return Err(service_error(
                py,
                503,
                "not_ready",
                "selection service is shutting down",
            ));
        }
        Ok(&self.app)
    }

    /// Runs one operation without the GIL and converts its answer.
    fn run<T, F>(&self, py: Python<'_>, f: F) -> PyResult<Py<PyAny>>
    where
        F: FnOnce(&App) -> Result<T, ApiError> + Send,
        T: Serialize + Send,
    {
        let app = self.live(py)?;
        let r = py.detach(|| f(app));
        match r {
            Ok(v) => to_py(py, &v),
            Err(e) => Err(api_error(py, &e)),
        }
    }

    /// A lifecycle call on a selection id (answers nothing on success).
    fn lifecycle<F>(&self, py: Python<'_>, f: F) -> PyResult<()>
    where
        F: FnOnce(&App) -> Result<(), ApiError> + Send,
    {
        let app = &*self.app;
        py.detach(|| f(app)).map_err(|e| api_error(py, &e))
    }
}

#[pymethods]
impl NativeService {
    /// `argv`: `kvr serve`'s flags (kvr/__init__.py builds them from Dynamo's arguments).
    #[new]
    fn new(py: Python<'_>, argv: Vec<String>) -> PyResult<Self> {
        let flags =
            Flags::try_parse_from(&argv).map_err(|e| PyValueError::new_err(e.to_string()))?;
        let app = py
            .detach(|| App::new(flags.args))
            .map_err(PyValueError::new_err)?;
        let replica_rt = match app.args.replica_sync_port {
            Some(_) => {
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(1)
                    .thread_name("kvr-replica")
                    .enable_all()
                    .build()
                    .map_err(|e| PyValueError::new_err(format!("replica sync runtime: {e}")))?;
                let a = app.clone();
                py.detach(|| rt.block_on(kvr_service::replica_sync::start(&a)))
                    .map_err(pyo3::exceptions::PyException::new_err)?;
                Some(rt)
            }
            None => None,
        };
        kvr_service::recovery::start(app.clone());
        let sweeper = Mutex::new(Sweeper::start(app.clone()));
        Ok(Self {
            app,
            shut: AtomicBool::new(false),
            sweeper,
            replica_rt: Mutex::new(replica_rt),
        })
    }

    /// Whether selections query a remote primary index (a network round trip per call).
    fn uses_remote_index(&self) -> bool {
        self.app.args.remote_indexer_url.is_some()
    }

    /// Adds or replaces a worker (Dynamo's worker dict) and subscribes to its KV events; answers its catalog record.
    fn upsert_worker(&self, py: Python<'_>, worker: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        let req: WorkerRequest = body(&worker_in(worker)?)?;
        let app = self.live(py)?;
        match py.detach(|| app.upsert_worker(req)) {
            Ok(r) => records_to_py(py, &r),
            Err(e) => Err(api_error(py, &e)),
        }
    }

    /// Changes some fields of a known worker; answers its catalog record.
    fn patch_worker(
        &self,
        py: Python<'_>,
        worker_id: u64,
        patch: &Bound<'_, PyAny>,
    ) -> PyResult<Py<PyAny>> {
        let id = worker_id;
        let p: WorkerPatch = body(&worker_in(patch)?)?;
        let app = self.live(py)?;
        match py.detach(|| app.patch_worker(id, p)) {
            Ok(r) => records_to_py(py, &r),
            Err(e) => Err(api_error(py, &e)),
        }
    }

    /// Removes a worker and stops its KV events; answers its last catalog record.
    /// (`worker_id` typed as Dynamo's: a non-int is pyo3's TypeError, as there.)
    fn delete_worker(&self, py: Python<'_>, worker_id: u64) -> PyResult<Py<PyAny>> {
        let id = worker_id;
        let app = &*self.app;
        match py.detach(|| app.delete_worker(id)) {
            Ok(r) => records_to_py(py, &r),
            Err(e) => Err(api_error(py, &e)),
        }
    }

    /// The catalog records, optionally of one model and routing group.
    #[pyo3(signature = (model_name=None, routing_group=None))]
    fn list_workers(
        &self,
        py: Python<'_>,
        model_name: Option<String>,
        routing_group: Option<String>,
    ) -> PyResult<Py<PyAny>> {
        let f = PartitionFilter {
            model_name,
            routing_group,
        };
        let app = &*self.app;
        records_to_py(py, &py.detach(|| app.list_workers(&f)))
    }

    /// Readiness: `ready`, the worker records and the streams that are not exact.
    fn ready(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let app = &*self.app;
        let out = records_to_py(py, &py.detach(|| app.ready()))?;
        // After `shutdown` nothing is served: not ready, as Dynamo's class answers.
        if self.shut.load(Ordering::Acquire) {
            if let Ok(d) = out.bind(py).cast::<PyDict>() {
                d.set_item("ready", false)?;
            }
        }
        Ok(out)
    }

    /// Every KV-event stream's health (kvr's addition): a list of dicts with
    /// `model_name`, `routing_group`, `worker_id`, `stream`, `state` (`exact`,
    /// `recovering`, `degraded`, `dead`), `reason`, `since_unix_ms`, `decode_errors` and
    /// `link_failures`. `ready()` lists the streams that are not exact.
    fn kv_event_sources(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let app = &*self.app;
        to_py(py, &py.detach(|| app.kv_event_sources()))
    }

    /// Each rank's booked load (prefill tokens, decode blocks, active requests).
    #[pyo3(signature = (model_name=None, routing_group=None))]
    fn loads(
        &self,
        py: Python<'_>,
        model_name: Option<String>,
        routing_group: Option<String>,
    ) -> PyResult<Py<PyAny>> {
        let f = PartitionFilter {
            model_name,
            routing_group,
        };
        let app = &*self.app;
        to_py(py, &py.detach(|| app.loads(&f)))
    }

    /// Chooses a rank for a request dict without booking it (or with `selection_id`, pending a claim).
    fn select(&self, py: Python<'_>, request: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        let b: SelectRequest = body(request)?;
        self.run(py, move |app| app.select(&b))
    }

    /// Chooses a rank and books the request on it; answers the choice and its `selection_id`.
    fn select_and_reserve(
        &self,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
    ) -> PyResult<Py<PyAny>> {
        let b: SelectRequest = body(request)?;
        self.run(py, move |app| app.select_and_reserve(&b))
    }

    /// Each candidate rank's load if the request were booked on it.
    fn potential_loads(&self, py: Python<'_>, request: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        let b: SelectRequest = body(request)?;
        self.run(py, move |app| app.potential_loads(&b))
    }

    /// Each candidate rank's cached-prefix overlap for the request, in blocks.
    fn overlap_scores(&self, py: Python<'_>, request: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        let b: SelectRequest = body(request)?;
        self.run(py, move |app| app.overlap_scores(&b))
    }

    /// Books a request on a rank the caller chose (or claims a pending selection).
    fn create_reservation(
        &self,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
    ) -> PyResult<Py<PyAny>> {
        let b: ReservationRequest = body(request)?;
        self.run(py, move |app| app.reserve(&b))
    }

    /// The booking's prefill is done: its prefill tokens leave the rank's load.
    fn prefill_complete(&self, py: Python<'_>, selection_id: &str) -> PyResult<()> {
        self.lifecycle(py, |app| app.prefill_complete(selection_id))
    }

    /// The booking's decode grew by one output block (optionally decaying its prefill credit).
    #[pyo3(signature = (selection_id, *, decay_fraction=None))]
    fn add_output_block(
        &self,
        py: Python<'_>,
        selection_id: &str,
        decay_fraction: Option<f64>,
    ) -> PyResult<()> {
        self.lifecycle(py, |app| app.output_block(selection_id, decay_fraction))
    }

    /// Ends a booking; its load leaves the rank.
    fn free_reservation(&self, py: Python<'_>, selection_id: &str) -> PyResult<()> {
        self.lifecycle(py, |app| app.free(selection_id))
    }

    /// The index as `GET /dump` answers it (what a peer recovers from).
    fn indexer_snapshot(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let app = &*self.app;
        to_py(py, &py.detach(|| app.dump()))
    }

    /// Recovers the index from the first peer whose `/dump` answers (blocking HTTP);
    /// false when none could be used.
    fn recover_indexer_from_peers(&self, py: Python<'_>, peers: Vec<String>) -> PyResult<bool> {
        let app = self.live(py)?;
        Ok(py.detach(|| kvr_service::recovery::recover_from(app, &peers)))
    }

    /// Connects to a peer replica's sync endpoint: True when it is new (Dynamo's method,
    /// synchronous there too).
    fn register_replica_peer(&self, py: Python<'_>, endpoint: &str) -> PyResult<bool> {
        let app = self.live(py)?;
        py.detach(|| app.register_replica_peer(endpoint))
            .map_err(|e| api_error(py, &e))
    }

    /// Disconnects from a peer replica: False when it was not one.
    fn deregister_replica_peer(&self, py: Python<'_>, endpoint: &str) -> PyResult<bool> {
        let app = self.live(py)?;
        py.detach(|| app.deregister_replica_peer(endpoint))
            .map_err(|e| api_error(py, &e))
    }

    /// The peer replicas, sorted (empty without replica sync).
    fn list_replica_peers(&self) -> Vec<String> {
        self.app.replica_peers()
    }

    /// The replica sync's counters (kvr's addition; empty without replica sync).
    fn replica_sync_stats(&self) -> std::collections::BTreeMap<&'static str, u64> {
        self.app
            .replicas
            .get()
            .map(|s| s.stats().named().into_iter().collect())
            .unwrap_or_default()
    }

    /// Stops the KV-event subscriptions and the sweeper, and with `--state-dir` writes
    /// every partition's final snapshot; later selections fail fast. Idempotent.
    fn shutdown(&self, py: Python<'_>) {
        if self.shut.swap(true, Ordering::AcqRel) {
            return;
        }
        let app = &*self.app;
        let sweeper = &self.sweeper;
        let replica_rt = &self.replica_rt;
        py.detach(|| {
            app.registry.stop_all();
            sweeper.lock().unwrap_or_else(|e| e.into_inner()).stop();
            if let Some(sync) = app.replicas.get() {
                sync.close();
            }
            if let Some(rt) = replica_rt.lock().unwrap_or_else(|e| e.into_inner()).take() {
                rt.shutdown_background();
            }
            // `--state-dir`: the final snapshots, as `kvr serve` writes at SIGTERM.
            if let Some(state) = &app.state {
                state.close();
            }
        });
    }
}

impl Drop for NativeService {
    fn drop(&mut self) {
        if !self.shut.swap(true, Ordering::AcqRel) {
            self.app.registry.stop_all();
            self.sweeper
                .get_mut()
                .unwrap_or_else(|e| e.into_inner())
                .stop();
            if let Some(state) = &self.app.state {
                state.close();
            }
        }
    }
}
