//! Helpers shared by the integration tests.

pub mod proc_guard;
