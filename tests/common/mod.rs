//! Helpers shared by the integration tests.

pub mod board;
pub mod control_daemon;
pub mod groups;
pub mod lifecycle;
pub mod proc_guard;
pub mod runtime;
