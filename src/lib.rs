//! runwarden — an actor-based process supervisor for a SQLite board of agent tasks.
#![deny(rust_2018_idioms)]

pub mod actors;
pub mod board;
pub mod cli;
pub mod config;
pub mod lock;
pub mod process;
pub mod supervisor;

pub use supervisor::{Services, Supervisor, SupervisorError, SupervisorHandle};
