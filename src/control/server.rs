//! The control server: binds the socket, checks each peer, caps the connections, and hands
//! each accepted connection to `conn`.
//!
//! It runs inside the supervisor's actix system (one thread): connections are local tasks, and
//! every request reaches the board through the [`Store`](crate::actors::store::Store), so the
//! server itself holds no board state and never writes SQL.

use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, watch};

use super::conn;
use super::protocol::{Response, code};
use crate::config::Config;
use crate::supervisor::Services;

/// Longest socket path the kernel accepts (`sun_path` is 108 bytes with its NUL).
const MAX_SOCKET_PATH: usize = 107;
/// How long a refusal line (unauthorized, too many connections) may take to write.
const REFUSAL_WRITE: Duration = Duration::from_secs(1);
/// How long `stop` waits for open connections to finish their in-flight replies.
const STOP_DRAIN: Duration = Duration::from_secs(2);
/// Pause after a failed accept (e.g. out of file descriptors) so the loop does not spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);
/// The longest the socket waits for the first reconcile before it accepts anyway (a /proc
/// probe stuck on a hung file system must not keep every client out), in milliseconds.
static FIRST_RECONCILE_WAIT_MS: std::sync::atomic::AtomicU64 =
    std::sync::atomic::AtomicU64::new(5_000);

/// Test hook: how long the socket waits for the first reconcile at most (5 s). Process-wide:
/// for a test binary of its own (a test that must see the gate open on the reconcile's
/// signal, not on this bound).
#[doc(hidden)]
pub fn set_first_reconcile_wait(wait: Duration) {
    FIRST_RECONCILE_WAIT_MS.store(wait.as_millis() as u64, std::sync::atomic::Ordering::SeqCst);
}

/// How long the socket (and `Supervisor::start`) waits for the first reconcile at most.
pub(crate) fn first_reconcile_wait() -> Duration {
    Duration::from_millis(FIRST_RECONCILE_WAIT_MS.load(std::sync::atomic::Ordering::SeqCst))
}

/// Why the control server could not start.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// A live supervisor already answers on the socket path.
    #[error("another supervisor is already listening on {0}")]
    AlreadyServing(PathBuf),
    /// Something that is not a socket is in the way; it is never deleted.
    #[error("{0} exists and is not a socket; refusing to replace it")]
    NotASocket(PathBuf),
    /// The path does not fit in a `sockaddr_un`.
    #[error("socket path {path} is {len} bytes long; Unix sockets allow at most {MAX_SOCKET_PATH}")]
    PathTooLong { path: PathBuf, len: usize },
    /// A file-system or socket call failed.
    #[error("cannot {action} {path}: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        source: io::Error,
    },
}

fn io_err<'a>(action: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> ControlError + 'a {
    move |source| ControlError::Io {
        action,
        path: path.to_path_buf(),
        source,
    }
}

/// What every connection shares.
pub(super) struct Shared {
    pub services: Services,
    pub socket: PathBuf,
    pub idle_timeout: Duration,
    pub max_request_bytes: usize,
    /// Fired by the `shutdown` op; the supervisor's run loop waits on it.
    pub shutdown: Arc<Notify>,
    /// Becomes true when the server stops: connections finish their replies and close.
    pub stopping: watch::Receiver<bool>,
}

/// The peer of one connection, as `SO_PEERCRED` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Peer {
    pub uid: u32,
    pub pid: Option<i32>,
    pub role: Role,
}

/// What a peer may do, by its uid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Role {
    /// Root, the supervisor's own uid, `[control] allowed_uids`: every op.
    Operator,
    /// The user an assignee runs as (and no operator): only a worker's reports on its own run,
    /// each authorized by the run's token — it cannot touch other runs, tasks or the supervisor.
    Worker,
}

/// The uids served, and as what.
struct Allowed {
    operators: Vec<u32>,
    workers: Vec<u32>,
}

impl Allowed {
    fn for_config(config: &Config) -> Allowed {
        let mut operators = config.control.allowed_uids.clone();
        operators.push(0);
        operators.push(nix::unistd::geteuid().as_raw());
        let workers = config
            .assignees
            .values()
            .filter_map(|a| a.uid)
            .filter(|u| !operators.contains(u))
            .collect();
        Allowed { operators, workers }
    }

    fn role(&self, uid: u32) -> Option<Role> {
        if self.operators.contains(&uid) {
            Some(Role::Operator)
        } else if self.workers.contains(&uid) {
            Some(Role::Worker)
        } else {
            None
        }
    }
}

/// A bound control socket, not yet served. Dropping it removes the socket file.
pub struct BoundSocket {
    listener: Option<std::os::unix::net::UnixListener>,
    socket: PathBuf,
    identity: (u64, u64),
}

impl BoundSocket {
    /// Starts serving with `services`. Must be called inside the supervisor's actix system.
    ///
    /// Connections are accepted once the first reconcile is done (`Services::first_reconcile`,
    /// or its dispatcher gone), or after 5 s
    /// (`set_first_reconcile_wait`): a restarted supervisor first takes over the workers of the
    /// previous one, so a report that was waiting for it lands on an adopted run, never ahead
    /// of the adoption. Until then clients wait in the listen queue.
    pub fn serve(mut self, services: Services) -> Result<ControlServer, ControlError> {
        let reconciled = services.first_reconcile.clone();
        let socket = self.socket.clone();
        let listener = self.listener.take().expect("a bound socket is served once");
        let listener = UnixListener::from_std(listener).map_err(io_err("listen on", &socket))?;
        let config = services.config.clone();
        let (stop, stopping) = watch::channel(false);
        let shutdown = Arc::new(Notify::new());
        let max_connections = config.control.max_connections.max(1);
        let connections = Arc::new(Semaphore::new(max_connections as usize));
        let allowed = Allowed::for_config(&config);
        let shared = Rc::new(Shared {
            services,
            socket: socket.clone(),
            idle_timeout: config.control.idle_timeout,
            max_request_bytes: usize::try_from(config.control.max_request_bytes)
                .unwrap_or(usize::MAX),
            shutdown: shutdown.clone(),
            stopping: stopping.clone(),
        });
        let slots = Slots::new(connections.clone(), max_connections);
        actix_rt::spawn(accept_loop(
            listener, shared, allowed, slots, stopping, reconciled,
        ));
        tracing::info!(socket = %socket.display(), "control socket listening");
        // The server owns the file from here on (and removes it when it stops).
        let identity = std::mem::take(&mut self.identity);
        Ok(ControlServer {
            socket,
            identity,
            stop,
            shutdown,
            connections,
            max_connections,
        })
    }
}

impl Drop for BoundSocket {
    fn drop(&mut self) {
        remove_if_ours(&self.socket, self.identity);
    }
}

/// Refuses, before anything is made, a socket path with something that is not a socket in
/// the way (never replaced; [`ControlServer::bind`] checks again when it binds).
pub fn check_socket_path(socket: &Path) -> Result<(), ControlError> {
    match std::fs::symlink_metadata(socket) {
        Ok(meta) if !meta.file_type().is_socket() => {
            Err(ControlError::NotASocket(socket.to_path_buf()))
        }
        _ => Ok(()),
    }
}

/// A running control server. Dropping it stops accepting and removes the socket file.
pub struct ControlServer {
    socket: PathBuf,
    /// (device, inode) of the socket we bound, so we only ever unlink our own.
    identity: (u64, u64),
    stop: watch::Sender<bool>,
    shutdown: Arc<Notify>,
    connections: Arc<Semaphore>,
    max_connections: u32,
}

impl ControlServer {
    /// Binds `config.socket_path()` (nothing is served yet). A stale socket (nobody answers)
    /// is replaced; a live one, or a file that is not a socket, is an error. Done before the
    /// actors start, so a supervisor that cannot serve its socket never starts a worker.
    pub fn bind(config: &Config) -> Result<BoundSocket, ControlError> {
        let socket = config.socket_path();
        let listener = bind(&socket, Modes::for_config(config))?;
        let meta = std::fs::symlink_metadata(&socket).map_err(io_err("stat", &socket))?;
        Ok(BoundSocket {
            listener: Some(listener),
            socket,
            identity: (meta.dev(), meta.ino()),
        })
    }

    /// The socket path being served.
    pub fn socket_path(&self) -> &Path {
        &self.socket
    }

    /// Resolves when a client has sent `shutdown`.
    pub fn shutdown_requested(&self) -> impl std::future::Future<Output = ()> + 'static {
        let notify = self.shutdown.clone();
        async move { notify.notified().await }
    }

    /// Stops accepting, lets open connections finish the replies already in flight (for at
    /// most two seconds), closes them and removes the socket file.
    pub async fn stop(&self) {
        let _ = self.stop.send(true);
        // Each connection holds a permit until it has closed; getting them all back means
        // every connection is done.
        let all = self.connections.acquire_many(self.max_connections);
        if tokio::time::timeout(STOP_DRAIN, all).await.is_err() {
            tracing::warn!("control: some connections did not close in time");
        }
        self.remove_socket();
    }

    fn remove_socket(&self) {
        remove_if_ours(&self.socket, self.identity);
    }
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        self.remove_socket();
    }
}

/// The file modes of the socket and of a directory made for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Modes {
    dir: u32,
    socket: u32,
}

impl Modes {
    /// 0600 (in 0700, for a directory made for it): only our uid (and root) can reach the
    /// socket. Other users to serve — `allowed_uids`, and assignees' users, whose workers
    /// report here — make the socket 0666 (and such a directory 0711: traversable, not
    /// listable), and the peer-uid check (`SO_PEERCRED`) is what refuses everyone else. The
    /// data dir's mode, the socket's directory by default, is `data_dir::set_modes`'s.
    fn for_config(config: &Config) -> Modes {
        let me = nix::unistd::geteuid().as_raw();
        let others = !config.control.allowed_uids.is_empty()
            || config
                .assignees
                .values()
                .any(|a| a.uid.is_some_and(|u| u != me));
        Modes {
            dir: if others { 0o711 } else { 0o700 },
            socket: if others { 0o666 } else { 0o600 },
        }
    }
}

/// Prepares the directory, clears a stale socket, binds, and sets the modes.
fn bind(socket: &Path, modes: Modes) -> Result<std::os::unix::net::UnixListener, ControlError> {
    let len = socket.as_os_str().len();
    if len > MAX_SOCKET_PATH {
        return Err(ControlError::PathTooLong {
            path: socket.to_path_buf(),
            len,
        });
    }
    let dir = socket
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let created = !dir.exists();
    std::fs::create_dir_all(dir).map_err(io_err("create directory", dir))?;
    // A directory made for the socket is 0700, so other users cannot even reach it. One that
    // was there is left as it is: the data dir's mode was set with the others (`set_modes`),
    // and a directory the admin chose (e.g. /run) is theirs; the socket's own mode and the
    // peer-uid check still apply.
    if created {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(modes.dir))
            .map_err(io_err("set the mode of", dir))?;
    }
    match std::fs::symlink_metadata(socket) {
        Ok(meta) if meta.file_type().is_socket() => {
            match std::os::unix::net::UnixStream::connect(socket) {
                Ok(_) => return Err(ControlError::AlreadyServing(socket.to_path_buf())),
                Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                    tracing::info!(socket = %socket.display(), "replacing a stale control socket");
                    std::fs::remove_file(socket).map_err(io_err("remove stale socket", socket))?;
                }
                Err(e) => return Err(io_err("check existing socket", socket)(e)),
            }
        }
        Ok(_) => return Err(ControlError::NotASocket(socket.to_path_buf())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err("stat", socket)(e)),
    }
    let listener =
        std::os::unix::net::UnixListener::bind(socket).map_err(io_err("bind", socket))?;
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(modes.socket))
        .map_err(io_err("set the mode of", socket))?;
    listener
        .set_nonblocking(true)
        .map_err(io_err("configure", socket))?;
    Ok(listener)
}

/// Unlinks `socket` if it is still the file we bound: a successor may have bound the same path.
fn remove_if_ours(socket: &Path, identity: (u64, u64)) {
    match std::fs::symlink_metadata(socket) {
        Ok(m) if (m.dev(), m.ino()) == identity => {
            if let Err(e) = std::fs::remove_file(socket) {
                tracing::warn!(socket = %socket.display(), error = %e, "cannot remove the control socket");
            }
        }
        _ => {}
    }
}

/// The connection slots: `max_connections` in all, of which an eighth (rounded down) only
/// operators may take — so the assignees' users, served for their own runs, can never lock
/// the operators out by holding every connection open.
struct Slots {
    all: Arc<Semaphore>,
    max: u32,
    /// What worker-role peers may hold between them.
    workers: Arc<Semaphore>,
    workers_max: u32,
}

/// A connection's hold on its slot(s); dropping it frees them.
pub(super) struct Slot {
    _all: OwnedSemaphorePermit,
    _worker: Option<OwnedSemaphorePermit>,
}

impl Slots {
    fn new(all: Arc<Semaphore>, max: u32) -> Slots {
        let workers_max = max - max / 8;
        Slots {
            all,
            max,
            workers: Arc::new(Semaphore::new(workers_max as usize)),
            workers_max,
        }
    }

    /// A slot for a peer of `role`, or the refusal to send it.
    fn take(&self, role: Role) -> Result<Slot, String> {
        let worker = match role {
            Role::Operator => None,
            Role::Worker => Some(self.workers.clone().try_acquire_owned().map_err(|_| {
                format!(
                    "too many connections from workers' users (at most {} of {}, the rest kept for operators); try again later",
                    self.workers_max, self.max
                )
            })?),
        };
        let all = self.all.clone().try_acquire_owned().map_err(|_| {
            format!(
                "too many connections (at most {}); try again later",
                self.max
            )
        })?;
        Ok(Slot {
            _all: all,
            _worker: worker,
        })
    }
}

async fn accept_loop(
    listener: UnixListener,
    shared: Rc<Shared>,
    allowed: Allowed,
    slots: Slots,
    mut stopping: watch::Receiver<bool>,
    mut reconciled: watch::Receiver<bool>,
) {
    let bound = first_reconcile_wait();
    tokio::select! {
        _ = stopping.changed() => return,
        // Done, or its dispatcher gone (an error): either way, nothing more to wait for.
        _ = reconciled.wait_for(|done| *done) => {}
        _ = tokio::time::sleep(bound) => {
            tracing::warn!(waited = ?bound, "control: the first reconcile has not finished; accepting anyway");
        }
    }
    let mut accept_failures = Throttle::default();
    loop {
        let accepted = tokio::select! {
            _ = stopping.changed() => break,
            accepted = listener.accept() => accepted,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of descriptors, say: retried every ACCEPT_BACKOFF, told once a minute.
                if let Some(more) = accept_failures.due() {
                    tracing::warn!(error = %e, failures_since_last_told = more, "control: accept failed; retrying");
                }
                tokio::time::sleep(ACCEPT_BACKOFF).await;
                continue;
            }
        };
        let cred = match stream.peer_cred() {
            Ok(cred) => cred,
            Err(e) => {
                tracing::warn!(error = %e, "control: cannot read the peer's credentials; refusing");
                actix_rt::spawn(refuse(
                    stream,
                    code::UNAUTHORIZED,
                    "cannot read your credentials".into(),
                ));
                continue;
            }
        };
        let Some(role) = allowed.role(cred.uid()) else {
            tracing::warn!(uid = cred.uid(), pid = ?cred.pid(), "control: refused a peer uid");
            let msg = format!(
                "uid {} may not use this socket (allowed: root, the supervisor's uid, [control] allowed_uids, and the assignees' users for their own runs)",
                cred.uid()
            );
            actix_rt::spawn(refuse(stream, code::UNAUTHORIZED, msg));
            continue;
        };
        let peer = Peer {
            uid: cred.uid(),
            pid: cred.pid(),
            role,
        };
        match slots.take(role) {
            Ok(slot) => {
                actix_rt::spawn(conn::serve(stream, shared.clone(), peer, slot));
            }
            Err(msg) => {
                tracing::debug!(uid = peer.uid, "control: {msg}");
                actix_rt::spawn(refuse(stream, code::TOO_MANY_CONNECTIONS, msg));
            }
        }
    }
    tracing::debug!(socket = %shared.socket.display(), "control: no longer accepting");
}

/// Says a repeated failure once per [`THROTTLE`], with how many went untold since.
#[derive(Default)]
struct Throttle {
    last: Option<std::time::Instant>,
    untold: u64,
}

/// How often a repeated failure is logged (see [`Throttle`]).
const THROTTLE: Duration = Duration::from_secs(60);

impl Throttle {
    /// `Some(untold)` when this failure is to be logged.
    fn due(&mut self) -> Option<u64> {
        if self.last.is_some_and(|at| at.elapsed() < THROTTLE) {
            self.untold += 1;
            return None;
        }
        self.last = Some(std::time::Instant::now());
        Some(std::mem::take(&mut self.untold))
    }
}

#[test]
fn a_repeated_failure_is_told_once_per_period_with_the_count_untold() {
    let mut t = Throttle::default();
    assert_eq!(t.due(), Some(0));
    assert_eq!(t.due(), None);
    assert_eq!(t.due(), None);
    t.last = Some(std::time::Instant::now() - THROTTLE);
    assert_eq!(t.due(), Some(2));
    assert_eq!(t.due(), None);
}

/// Sends one error line and closes.
async fn refuse(mut stream: UnixStream, code: &'static str, message: String) {
    let line = Response::error(None, code, message).to_line();
    let _ = tokio::time::timeout(REFUSAL_WRITE, async {
        stream.write_all(&line).await?;
        stream.shutdown().await
    })
    .await;
}
