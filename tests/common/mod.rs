//! Helpers shared by the integration tests.

pub mod board;
pub mod proc_guard;
pub mod runtime;
pub mod lifecycle;
pub mod control_daemon;
