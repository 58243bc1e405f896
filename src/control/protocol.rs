//! The control protocol's types: what a request and a response line are.
//!
//! Newline-delimited JSON over a Unix socket. Each request is one JSON object on one line with a
//! client-chosen `id` and an `op`; each response is one line carrying the same `id`. The full
//! description, with examples, is `docs/protocol.md`; this module is its typed form, shared by
//! the server and the [client](super::client).
//!
//! Parsing is layered: bytes → UTF-8 → JSON object → `id` → `op` → the op's fields. Each layer
//! that fails produces a [`ParseError`] naming what was wrong, and the connection goes on.

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::params;
use crate::board::{Event, EventId, Millis, NewTask, RunId, Task, TaskFilter, TaskId};

/// The protocol version this build speaks. A client whose major version differs is refused.
pub const PROTOCOL_VERSION: &str = "1.0";

/// The major part of [`PROTOCOL_VERSION`].
pub const PROTOCOL_MAJOR: u64 = 1;

/// Longest string `id` accepted, in bytes. The id is echoed on every reply and on every line of
/// a followed stream, so an unbounded one would multiply whatever a client sends.
pub const MAX_ID_BYTES: usize = 256;

/// The stable error codes of [`ErrorBody::code`].
pub mod code {
    /// The request is malformed: bad JSON, unknown op, a missing or mistyped field, no hello.
    pub const BAD_REQUEST: &str = "bad_request";
    /// The client's protocol major version is not this server's.
    pub const UNSUPPORTED_VERSION: &str = "unsupported_version";
    /// The peer's uid may not use the socket, or a run token is wrong. The connection is closed
    /// after a peer-uid refusal.
    pub const UNAUTHORIZED: &str = "unauthorized";
    /// A request line is longer than `max_request_bytes`; the connection is closed.
    pub const TOO_LARGE: &str = "too_large";
    /// The server already serves `max_connections` clients; the connection is closed.
    pub const TOO_MANY_CONNECTIONS: &str = "too_many_connections";
    /// No request for `idle_timeout`; the connection is closed.
    pub const IDLE_TIMEOUT: &str = "idle_timeout";
    /// A followed `events` request while the connection already has its maximum of open
    /// streams; the connection goes on.
    pub const TOO_MANY_STREAMS: &str = "too_many_streams";
    /// No such task or run.
    pub const NOT_FOUND: &str = "not_found";
    /// The task is not in a state that allows this (e.g. its worker is alive; use `force`).
    pub const CONFLICT: &str = "conflict";
    /// The run is no longer its task's current run (reclaimed, timed out, closed).
    pub const STALE_RUN: &str = "stale_run";
    /// The supervisor is stopping; try again later.
    pub const UNAVAILABLE: &str = "unavailable";
    /// The database is locked by another process for too long.
    pub const BUSY: &str = "busy";
    /// The disk is full; nothing was written.
    pub const DISK_FULL: &str = "disk_full";
    /// Anything else (a bug or an I/O failure); the message says what.
    pub const INTERNAL: &str = "internal";
}

/// The `id` a client puts on a request and gets back on its response: a non-negative integer
/// or a string. Responses to lines whose id could not be read carry `null`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(untagged)]
pub enum RequestId {
    /// A number, e.g. `7`.
    Num(u64),
    /// A string, e.g. `"a7"`.
    Str(String),
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RequestId::Num(n) => write!(f, "{n}"),
            RequestId::Str(s) => write!(f, "{s:?}"),
        }
    }
}

impl From<u64> for RequestId {
    fn from(n: u64) -> Self {
        RequestId::Num(n)
    }
}

macro_rules! requests {
    ($( $(#[$doc:meta])* $variant:ident($ty:ty) = $op:literal; )+) => {
        /// One request: the `op` names the variant, the other keys (besides `id`) are its fields.
        #[derive(Debug, Clone, PartialEq, Serialize)]
        #[serde(tag = "op")]
        pub enum Request {
            $( $(#[$doc])* #[serde(rename = $op)] $variant($ty), )+
        }

        impl Request {
            /// Every op name, in the order of the variants.
            pub const OPS: &'static [&'static str] = &[$($op),+];

            /// This request's op name.
            pub fn op(&self) -> &'static str {
                match self { $(Request::$variant(_) => $op,)+ }
            }

            /// Decodes the fields of `op` (the object without `id` and `op`).
            fn from_fields(op: &str, fields: Map<String, Value>) -> Result<Request, String> {
                match op {
                    $($op => params::from_map(fields).map(Request::$variant).map_err(|e| format!("{}: {e}", $op)),)+
                    other => Err(format!("unknown op `{other}` (known: {})", Request::OPS.join(", "))),
                }
            }
        }
    };
}

requests! {
    /// `{"op":"hello","version":"1.0"}` → [`HelloReply`]: must be the first request on a connection.
    Hello(Hello) = "hello";
    /// `{"op":"add_task","title":"x","assignee":"coder"}` → [`crate::board::Created`].
    AddTask(NewTask) = "add_task";
    /// `{"op":"list_tasks","status":"ready","assignee":"coder","limit":50}` → [`TasksReply`]
    /// (`limit` default 1000, clamped to at most 10000).
    ListTasks(TaskFilter) = "list_tasks";
    /// `{"op":"show_task","task":3}` → [`crate::board::TaskDetail`] (task, links, runs, events, comments).
    ShowTask(ShowTask) = "show_task";
    /// `{"op":"complete","task":3,"result":"ok"}` (+ `run`/`token` from a worker, or `force`) → [`TaskReply`].
    Complete(Complete) = "complete";
    /// `{"op":"block","task":3,"reason":"needs a human"}` (+ `run`/`token`, or `force`) → [`TaskReply`].
    Block(Block) = "block";
    /// `{"op":"unblock","task":3}` → [`TaskReply`]: a blocked task goes back to ready (or todo).
    Unblock(TaskRef) = "unblock";
    /// `{"op":"archive","task":3}` → [`TaskReply`]: put away (a running task's run closes `archived`).
    Archive(TaskRef) = "archive";
    /// `{"op":"reclaim","task":3,"reason":"stuck"}` → [`TaskReply`]: release a running task to ready.
    Reclaim(Reclaim) = "reclaim";
    /// `{"op":"link","parent":1,"child":2}` → [`LinkReply`]: the child waits for the parent.
    Link(Link) = "link";
    /// `{"op":"comment","task":3,"body":"looks good"}` → [`CommentReply`].
    Comment(CommentReq) = "comment";
    /// `{"op":"heartbeat","task":3,"run":9,"token":"…","note":"50%"}` → [`HeartbeatReply`].
    Heartbeat(Heartbeat) = "heartbeat";
    /// `{"op":"events","since":0,"task":3,"follow":false}` → [`EventsReply`], or with `follow` a
    /// [`FollowReply`] then one [`Response::Event`] line per event as it commits.
    Events(Events) = "events";
    /// `{"op":"status"}` → [`StatusReply`]: pid, uptime, version, live workers, counts.
    Status(Empty) = "status";
    /// `{"op":"read_log","task":3,"offset":0}` → [`ReadLogReply`]: a piece of the task's log,
    /// for operators who may not read the file itself.
    ReadLog(ReadLog) = "read_log";
    /// `{"op":"reap_now"}` → [`ReapReply`]: run the terminal-reaper sweep now.
    ReapNow(Empty) = "reap_now";
    /// `{"op":"shutdown"}` → [`ShutdownReply`]: the supervisor stops gracefully.
    Shutdown(Empty) = "shutdown";
}

impl Request {
    /// True for a request answered with a whole task ([`TaskReply`]).
    pub fn replies_with_task(&self) -> bool {
        matches!(
            self,
            Request::Complete(_)
                | Request::Block(_)
                | Request::Unblock(_)
                | Request::Archive(_)
                | Request::Reclaim(_)
        )
    }

    /// True for the ops that only go through the store's write transaction. These pipeline:
    /// the server submits them in arrival order without waiting for earlier replies. Every other
    /// op waits until all earlier requests of its connection have been answered, so a read
    /// always sees the effects of the writes sent before it.
    pub fn is_pipelined_write(&self) -> bool {
        matches!(
            self,
            Request::AddTask(_)
                | Request::Complete(_)
                | Request::Block(_)
                | Request::Unblock(_)
                | Request::Archive(_)
                | Request::Reclaim(_)
                | Request::Link(_)
                | Request::Comment(_)
                | Request::Heartbeat(_)
        )
    }
}

impl<'de> Deserialize<'de> for Request {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let mut fields = Map::<String, Value>::deserialize(d)?;
        let op = match fields.remove("op") {
            Some(Value::String(op)) => op,
            Some(_) => return Err(serde::de::Error::custom("`op` must be a string")),
            None => return Err(serde::de::Error::missing_field("op")),
        };
        Request::from_fields(&op, fields).map_err(serde::de::Error::custom)
    }
}

/// `hello`: the client's protocol version (`"1.0"`) and, optionally, its name for the logs.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hello {
    /// The client's protocol version, `"MAJOR.MINOR"`.
    pub version: String,
    /// The client's name, for the logs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client: Option<String>,
}

/// No fields.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Empty {}

/// A request about one task.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskRef {
    /// The task.
    pub task: TaskId,
}

/// `show_task`: the task and how many of its most recent events to include (default 50).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShowTask {
    /// The task.
    pub task: TaskId,
    /// How many of its most recent events to include (default 50).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub events: Option<u32>,
}

/// `complete`. A worker sends `run` and `token` (its own run); an operator sends neither and is
/// refused while the task's worker may be alive, unless `force`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Complete {
    /// The task.
    pub task: TaskId,
    /// A worker's own run (with `token`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run: Option<RunId>,
    /// The run's token (`RUNWARDEN_RUN_TOKEN`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
    /// The result to record.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<String>,
    /// An operator's override: close the run even if its worker may be alive.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub force: bool,
}

/// `block`: like [`Complete`], with the reason a human must read.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Block {
    /// The task.
    pub task: TaskId,
    /// A worker's own run (with `token`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run: Option<RunId>,
    /// The run's token (`RUNWARDEN_RUN_TOKEN`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
    /// Why; shown to whoever unblocks it. Must not be empty.
    pub reason: String,
    /// An operator's override: close the run even if its worker may be alive.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub force: bool,
}

/// `reclaim`: release a running task (its worker is ended at once).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Reclaim {
    /// The task.
    pub task: TaskId,
    /// Recorded on the closed run (default: who reclaimed it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// `link`: `child` waits for `parent`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Link {
    /// The task to wait for.
    pub parent: TaskId,
    /// The task that waits.
    pub child: TaskId,
}

/// `comment`: `author` defaults to the peer's user name.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CommentReq {
    /// The task.
    pub task: TaskId,
    /// The comment.
    pub body: String,
    /// Shown with the comment (default: the peer's user name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub author: Option<String>,
}

/// `heartbeat`: a worker vouching for its own run; refreshes the heartbeat and the lease.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Heartbeat {
    /// The worker's task.
    pub task: TaskId,
    /// The worker's run.
    pub run: RunId,
    /// The run's token.
    pub token: String,
    /// A progress note, recorded in the event.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// `events`: events with id greater than `since` (default 0), optionally of one task; at most
/// `limit` (default 1000, at most 10000) unless following.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Events {
    /// Only events with a greater id (0: from the start).
    #[serde(default)]
    pub since: EventId,
    /// Only this task's events.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task: Option<TaskId>,
    /// Page size without `follow` (default 1000, at most 10000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
    /// Keep streaming events as they commit.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub follow: bool,
}

/// The body of a refusal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// One of [`code`].
    pub code: String,
    /// One line saying what was wrong.
    pub message: String,
}

/// One line from the server.
#[derive(Debug, Clone, PartialEq)]
pub enum Response {
    /// `{"id":1,"ok":true,"result":{…}}`: the request succeeded; its effect is committed.
    Ok {
        id: Option<RequestId>,
        result: Value,
    },
    /// `{"id":1,"ok":false,"error":{"code":"…","message":"…"}}`: the request was refused.
    Err {
        id: Option<RequestId>,
        error: ErrorBody,
    },
    /// `{"id":1,"event":{…}}`: one event of the followed `events` request `id`.
    Event { id: Option<RequestId>, event: Event },
}

impl Response {
    /// The id of the request this line answers.
    pub fn id(&self) -> Option<&RequestId> {
        match self {
            Response::Ok { id, .. } | Response::Err { id, .. } | Response::Event { id, .. } => {
                id.as_ref()
            }
        }
    }

    /// A refusal with `code` and `message`.
    pub fn error(id: Option<RequestId>, code: &str, message: impl Into<String>) -> Response {
        Response::Err {
            id,
            error: ErrorBody {
                code: code.to_string(),
                message: message.into(),
            },
        }
    }

    /// The line of a success, `{"id":…,"ok":true,"result":…}` and a newline, serialized
    /// straight from `result` (no intermediate `Value`: a large reply is encoded once).
    pub fn ok_line<T: Serialize>(
        id: Option<&RequestId>,
        result: &T,
    ) -> Result<Vec<u8>, serde_json::Error> {
        // Same keys, in the same order, as `Response::Ok` serializes.
        #[derive(Serialize)]
        struct OkLine<'a, T> {
            id: Option<&'a RequestId>,
            ok: bool,
            result: &'a T,
        }
        let mut line = serde_json::to_vec(&OkLine {
            id,
            ok: true,
            result,
        })?;
        line.push(b'\n');
        Ok(line)
    }

    /// The line to send: compact JSON and a newline.
    pub fn to_line(&self) -> Vec<u8> {
        let mut line = serde_json::to_vec(self).unwrap_or_else(|e| {
            // Only a non-string map key could fail here; answer with a refusal instead of panicking.
            serde_json::to_vec(&Response::error(
                self.id().cloned(),
                code::INTERNAL,
                format!("cannot encode response: {e}"),
            ))
            .unwrap_or_default()
        });
        line.push(b'\n');
        line
    }
}

impl Serialize for Response {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = s.serialize_map(Some(3))?;
        match self {
            Response::Ok { id, result } => {
                map.serialize_entry("id", id)?;
                map.serialize_entry("ok", &true)?;
                map.serialize_entry("result", result)?;
            }
            Response::Err { id, error } => {
                map.serialize_entry("id", id)?;
                map.serialize_entry("ok", &false)?;
                map.serialize_entry("error", error)?;
            }
            Response::Event { id, event } => {
                map.serialize_entry("id", id)?;
                map.serialize_entry("event", event)?;
            }
        }
        map.end()
    }
}

/// The wire shape every response line has, before it is told apart.
#[derive(Deserialize)]
struct RawResponse {
    id: Option<RequestId>,
    ok: Option<bool>,
    result: Option<Value>,
    error: Option<ErrorBody>,
    event: Option<Event>,
}

impl<'de> Deserialize<'de> for Response {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = RawResponse::deserialize(d)?;
        match (raw.ok, raw.result, raw.error, raw.event) {
            (Some(true), result, None, None) => Ok(Response::Ok {
                id: raw.id,
                result: result.unwrap_or(Value::Null),
            }),
            (Some(false), None, Some(error), None) => Ok(Response::Err { id: raw.id, error }),
            (None, None, None, Some(event)) => Ok(Response::Event { id: raw.id, event }),
            _ => Err(serde::de::Error::custom(
                "a response has `ok` with `result` or `error`, or an `event`",
            )),
        }
    }
}

/// Why a request line could not be turned into a [`Request`]. Always answered with
/// `bad_request` (and the id, when it could be read); the connection goes on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseError {
    /// The request's id, when it could be read.
    pub id: Option<RequestId>,
    /// What was wrong.
    pub message: String,
}

/// How [`UniqueKeys`]' error starts.
const DUPLICATE: &str = "duplicate field";

/// A request's top-level object, and the first key it gives twice (`"op"`, `"id"`): that is
/// an error, not silently "the last one wins", as unknown fields are errors. The whole object
/// is read first, so the error can carry the request's id when the id itself is not the key
/// given twice.
struct UniqueKeys {
    fields: Map<String, Value>,
    /// The first key given twice; `"id"` whenever the id is one of them.
    twice: Option<String>,
}

impl<'de> Deserialize<'de> for UniqueKeys {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Keys;
        impl<'de> serde::de::Visitor<'de> for Keys {
            type Value = UniqueKeys;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<UniqueKeys, A::Error> {
                let mut fields = Map::new();
                let mut twice = None;
                while let Some(key) = map.next_key::<String>()? {
                    let value: Value = map.next_value()?;
                    if fields.contains_key(&key) {
                        // An id given twice wins: the answer must not carry either of them.
                        if key == "id" {
                            twice = Some(key);
                        } else {
                            twice.get_or_insert(key);
                        }
                    } else {
                        fields.insert(key, value);
                    }
                }
                Ok(UniqueKeys { fields, twice })
            }
        }
        d.deserialize_map(Keys)
    }
}

/// Parses one request line (without its newline).
pub fn parse_request(line: &[u8]) -> Result<(RequestId, Request), ParseError> {
    let fail = |id: Option<RequestId>, message: String| ParseError { id, message };
    let text = std::str::from_utf8(line).map_err(|e| {
        fail(
            None,
            format!(
                "request is not valid UTF-8 (invalid byte at offset {})",
                e.valid_up_to()
            ),
        )
    })?;
    let twice = |key: &str| format!("{DUPLICATE} `{key}`: a request gives each field once");
    let (mut fields, twice_key) = match serde_json::from_str::<UniqueKeys>(text) {
        // Which of two ids would be the request's is not for the server to guess.
        Ok(UniqueKeys {
            twice: Some(key), ..
        }) if key == "id" => return Err(fail(None, twice(&key))),
        Ok(UniqueKeys { fields, twice }) => (fields, twice),
        // Not an object, or not JSON: parsed again for a plainer message (errors only).
        Err(_) => {
            let value: Value = serde_json::from_str(text)
                .map_err(|e| fail(None, format!("malformed JSON: {e}")))?;
            return Err(fail(
                None,
                format!("a request must be a JSON object, not {}", kind_of(&value)),
            ));
        }
    };
    let id = match fields.remove("id") {
        None | Some(Value::Null) => return Err(fail(None, "missing field `id`".into())),
        Some(v) => serde_json::from_value::<RequestId>(v.clone()).map_err(|_| {
            fail(
                None,
                format!(
                    "field `id` must be a non-negative integer or a string, not {}",
                    match &v {
                        Value::Number(n) if n.is_i64() => "a negative number",
                        Value::Number(n) if n.as_f64().is_some_and(|f| f < 0.0) => {
                            "a negative number"
                        }
                        Value::Number(n) if n.as_f64().is_some_and(|f| f.fract() != 0.0) => {
                            "a fraction"
                        }
                        Value::Number(n) if n.as_f64().is_some_and(|f| f >= u64::MAX as f64) => {
                            "a number above 2^64 - 1"
                        }
                        Value::Number(_) => "a number written with a decimal point or exponent",
                        other => kind_of(other),
                    }
                ),
            )
        })?,
    };
    if let RequestId::Str(s) = &id
        && s.len() > MAX_ID_BYTES
    {
        // Not echoed: answering with it would be the amplification the limit prevents.
        return Err(fail(
            None,
            format!(
                "field `id`: a string id is at most {MAX_ID_BYTES} bytes, got {}",
                s.len()
            ),
        ));
    }
    if let Some(key) = twice_key {
        return Err(fail(Some(id), twice(&key)));
    }
    let op = match fields.remove("op") {
        Some(Value::String(op)) => op,
        Some(v) => {
            return Err(fail(
                Some(id),
                format!("field `op` must be a string, not {}", kind_of(&v)),
            ));
        }
        None => return Err(fail(Some(id), "missing field `op`".into())),
    };
    match Request::from_fields(&op, fields) {
        Ok(req) => Ok((id, req)),
        Err(message) => Err(fail(Some(id), message)),
    }
}

/// How a JSON value is named in messages.
fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// The major number of a `"MAJOR.MINOR"` version (both decimal numbers); `None` for anything
/// else (`"1"`, `"1.x"`, `"1.0.5"`).
pub fn major_version(version: &str) -> Option<u64> {
    let (major, minor) = version.split_once('.')?;
    let number = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !number(major) || !number(minor) {
        return None;
    }
    // Too large for a u64 is still a well-formed version, just not one served here.
    Some(major.parse().unwrap_or(u64::MAX))
}

/// `hello` succeeded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HelloReply {
    /// The server's protocol version.
    pub protocol: String,
    /// The runwarden version serving.
    pub server: String,
    /// The supervisor's pid.
    pub pid: u32,
}

/// `list_tasks`: matching tasks, newest first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TasksReply {
    /// The tasks.
    pub tasks: Vec<Task>,
    /// More tasks matched than fit in one reply (their text over
    /// [`MAX_REPLY_TEXT_BYTES`]); absent when false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub truncated: bool,
}

/// About the most text one reply carries: task text (titles, bodies, results) in a
/// `list_tasks` reply, whose rest is left out and the reply says `truncated`; event payload
/// text in an `events` page (or a follow's catch-up page), which is cut there with `more`, the
/// next page going on from its `last_id`.
pub const MAX_REPLY_TEXT_BYTES: usize = 16 * 1024 * 1024;

/// A transition succeeded; the task as it is after it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskReply {
    /// The task after the transition.
    pub task: Task,
}

/// `link` succeeded (or the link already existed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinkReply {
    /// The task waited for.
    pub parent: TaskId,
    /// The task that waits.
    pub child: TaskId,
}

/// `comment` succeeded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommentReply {
    /// The new comment's id.
    pub comment_id: i64,
}

/// `heartbeat` succeeded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeartbeatReply {
    /// When the run's lease now expires (ms since the epoch).
    pub lease_expires_at: Millis,
}

/// `events` without `follow`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EventsReply {
    /// The events, in id order.
    pub events: Vec<Event>,
    /// The id to pass as `since` for the next page: the last event's id, or `since` if none.
    pub last_id: EventId,
    /// True when `limit` cut the page short: ask again from `last_id`.
    pub more: bool,
}

/// `events` with `follow`: the stream has started; event lines follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FollowReply {
    /// Always true.
    pub following: bool,
    /// Events after this id follow.
    pub since: EventId,
}

/// One live worker of this incarnation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LiveWorker {
    /// The run.
    pub run_id: RunId,
    /// Its task.
    pub task_id: TaskId,
    /// None while the process is being started.
    pub pid: Option<i32>,
}

/// `status`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatusReply {
    /// The supervisor's pid.
    pub pid: u32,
    /// runwarden's version.
    pub version: String,
    /// The protocol version served.
    pub protocol: String,
    /// When this supervisor started (ms since the epoch).
    pub started_at: Millis,
    pub uptime_ms: u64,
    /// The data directory.
    pub data_dir: PathBuf,
    /// Where the workers' logs are (`<data_dir>/logs`).
    pub logs_dir: PathBuf,
    /// The control socket.
    pub socket: PathBuf,
    /// Workers of this incarnation.
    pub live_workers: Vec<LiveWorker>,
    /// Tasks per status; every status is present.
    pub counts: BTreeMap<String, i64>,
    /// Tasks waiting (`todo`, `ready`) for an assignee the config does not have, by assignee:
    /// they do not run until it is configured again (or they are archived). Empty: omitted.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub unconfigured_assignees: BTreeMap<String, i64>,
    /// The newest event's id.
    pub last_event_id: EventId,
}

/// Most bytes of a log one `read_log` reply carries.
pub const MAX_LOG_CHUNK: u64 = 1024 * 1024;

/// `read_log`: up to `max_bytes` (default and at most [`MAX_LOG_CHUNK`]) of task `task`'s
/// log from byte `offset` (default 0).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReadLog {
    /// The task.
    pub task: TaskId,
    /// Where to start, in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offset: Option<u64>,
    /// At most this many bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_bytes: Option<u64>,
    /// Read the log's backup (`<log>.1`) instead: after a rotation, what a follower had not
    /// read yet is at its end (see [`ReadLogReply::backup_start`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub backup: bool,
}

/// `read_log`: the bytes from `offset` to `next` as text (invalid UTF-8 replaced; a character
/// cut by the end of the piece is left for the next one), and the log's size now. `next ==
/// size`: the end for now. A follower starts again from 0 when `rotation` changes, or when
/// `offset > size` (the log was truncated).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadLogReply {
    pub offset: u64,
    pub next: u64,
    pub size: u64,
    pub data: String,
    /// Which rotation the piece was read in: an opaque token that changes each time the log
    /// is rotated (absent before the first). A follower that sees it change starts again from
    /// 0 — the log may have grown past its offset again since, so the size alone cannot say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rotation: Option<String>,
    /// With `backup`: where the backup's first byte was in the log it was rotated from (a
    /// follower at offset `o` of that log goes on at `o - backup_start` of the backup)...
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backup_start: Option<u64>,
    /// ...and the `rotation` of the backup it replaced: a follower that last saw another one
    /// missed a rotation, and its offset means nothing in this backup. Both absent when the
    /// file system keeps no extended attributes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replaces: Option<String>,
}

/// `reap_now`: the sweep was started.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReapReply {
    /// Closed runs whose worker is scheduled to be ended after its grace.
    pub pending: usize,
}

/// `shutdown`: the supervisor is stopping.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShutdownReply {
    pub stopping: bool,
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_request_round_trips_through_its_wire_form() {
        let req = Request::Complete(Complete {
            task: 3,
            run: Some(9),
            token: Some("t".into()),
            result: Some("ok".into()),
            force: false,
        });
        let mut v = serde_json::to_value(&req).unwrap();
        assert_eq!(v["op"], "complete");
        v["id"] = json!(1);
        let line = serde_json::to_vec(&v).unwrap();
        assert_eq!(parse_request(&line).unwrap(), (RequestId::Num(1), req));
    }

    #[test]
    fn every_op_name_matches_its_serialized_tag() {
        let reqs = [
            Request::Hello(Hello::default()),
            Request::AddTask(NewTask::default()),
            Request::Status(Empty {}),
            Request::Events(Events::default()),
        ];
        for r in reqs {
            assert_eq!(serde_json::to_value(&r).unwrap()["op"], r.op());
        }
    }

    #[test]
    fn parse_errors_name_what_was_wrong() {
        let err = |s: &[u8]| parse_request(s).unwrap_err();
        assert!(err(b"{nope").message.starts_with("malformed JSON"));
        assert!(err(b"[1]").message.contains("JSON object"));
        assert!(err(b"\xff\xfe").message.contains("UTF-8"));
        assert!(err(br#"{"op":"status"}"#).message.contains("`id`"));
        let e = err(br#"{"id":4,"op":"frobnicate"}"#);
        assert_eq!(e.id, Some(RequestId::Num(4)));
        assert!(
            e.message.contains("unknown op `frobnicate`"),
            "{}",
            e.message
        );
        let e = err(br#"{"id":"x","op":"show_task","task":"seven"}"#);
        assert_eq!(e.id, Some(RequestId::Str("x".into())));
        assert!(e.message.contains("field `task`"), "{}", e.message);
        let e = err(br#"{"id":1,"op":"add_task","title":"a","colour":"red"}"#);
        assert!(
            e.message.contains("unknown field `colour`"),
            "{}",
            e.message
        );
    }

    #[test]
    fn responses_round_trip() {
        for r in [
            Response::Ok {
                id: Some(RequestId::Num(1)),
                result: json!({"id": 5}),
            },
            Response::error(
                Some(RequestId::Str("a".into())),
                code::NOT_FOUND,
                "task 5 not found",
            ),
            Response::error(None, code::BAD_REQUEST, "malformed JSON"),
        ] {
            let line = r.to_line();
            assert_eq!(line.last(), Some(&b'\n'));
            let back: Response = serde_json::from_slice(&line).unwrap();
            assert_eq!(back, r);
        }
    }

    #[test]
    fn a_long_string_id_is_refused_without_being_echoed() {
        let at_limit = "i".repeat(MAX_ID_BYTES);
        let line = format!(r#"{{"id":"{at_limit}","op":"status"}}"#);
        assert_eq!(
            parse_request(line.as_bytes()).unwrap().0,
            RequestId::Str(at_limit)
        );
        let over = "i".repeat(MAX_ID_BYTES + 1);
        let line = format!(r#"{{"id":"{over}","op":"status"}}"#);
        let e = parse_request(line.as_bytes()).unwrap_err();
        assert_eq!(e.id, None);
        assert!(e.message.contains("at most 256 bytes"), "{}", e.message);
    }

    #[test]
    fn ok_line_says_what_an_ok_response_says() {
        let result = HelloReply {
            protocol: "1.0".into(),
            server: "x".into(),
            pid: 7,
        };
        for id in [
            None,
            Some(RequestId::Num(3)),
            Some(RequestId::Str("a".into())),
        ] {
            let direct = Response::ok_line(id.as_ref(), &result).unwrap();
            assert_eq!(direct.last(), Some(&b'\n'));
            assert!(!direct[..direct.len() - 1].contains(&b'\n'), "one line");
            let expected = Response::Ok {
                id,
                result: serde_json::to_value(&result).unwrap(),
            };
            // The same object (keys may come in another order: a `Value` sorts them).
            let back: Response = serde_json::from_slice(&direct).unwrap();
            assert_eq!(back, expected);
        }
    }

    #[test]
    fn major_version_parses() {
        assert_eq!(major_version("1.0"), Some(1));
        assert_eq!(major_version("2.7"), Some(2));
        for bad in ["2", "1.x", "1.0.5", " 1.0", "+1.0", "1.", ".1", ""] {
            assert_eq!(major_version(bad), None, "{bad:?}");
        }
        assert_eq!(major_version("x.1"), None);
        // Well formed, however large: another major (answered unsupported_version).
        assert_eq!(major_version("99999999999999999999.0"), Some(u64::MAX));
    }
}
