//! The control socket: how the CLI, workers and other programs talk to a running supervisor.
//!
//! Newline-delimited JSON over a Unix socket (`Config::socket_path()`, mode 0600 in a 0700
//! directory), one request object per line and one response per line, matched by a
//! client-chosen `id`. The protocol is documented in `docs/protocol.md`.
//!
//! Layout:
//! - [`protocol`]: the typed `Request` / `Response` and reply types, shared by both ends, and
//!   the parsing of a request line (with `params` naming the offending field of a bad request);
//! - [`server`]: [`ControlServer`] binds the socket, checks each peer's uid (`SO_PEERCRED`),
//!   caps the connections; `conn` runs one connection (pipelined requests, ordered replies,
//!   limits), `out` queues its replies (bounded in bytes) for its writer, `ops` implements
//!   each op over the store, `follow` streams events without gaps;
//! - [`client`]: a blocking [`client::Client`] with one typed method per op.

pub mod client;
mod conn;
mod follow;
mod ops;
mod out;
mod params;
pub mod protocol;
pub mod server;

pub use server::{ControlError, ControlServer};
