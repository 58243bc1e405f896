//! One-line error messages that name the key and, when the text allows, its line and column.
//!
//! toml gives either a position (parsing a document) or a key path (deserializing a
//! `toml::Value`), never both on one line. So the schema is checked against the parsed table,
//! which names the key, and the position is found afterwards by walking a span-carrying parse
//! of the same text to that key.

use std::collections::BTreeMap;
use std::fmt;

use serde::Deserialize;
use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use toml::Spanned;

use super::HookConfig;

/// A config mistake: where it is (a key path such as `["assignees", "coder", "command"]`) and
/// the message, already prefixed with the key it names.
#[derive(Debug)]
pub(super) struct Problem {
    /// The key path used to find the line; may go one step deeper than the message's prefix
    /// (an unknown key is reported "in [section]" but located at the key itself).
    location: Vec<String>,
    text: String,
}

impl Problem {
    /// `message` about the key at `path`, rendered "[section] key: message".
    pub(super) fn at(path: &[&str], message: impl fmt::Display) -> Problem {
        let path: Vec<String> = path.iter().map(|s| s.to_string()).collect();
        let text = match describe(&path) {
            Some(key) => format!("{key}: {message}"),
            None => message.to_string(),
        };
        Problem {
            location: path,
            text,
        }
    }

    /// A key that the table at `table` does not accept.
    fn unknown_key(table: Vec<String>, key: &str, expected: &str) -> Problem {
        let place = match describe(&table) {
            Some(section) => format!("in {section}"),
            None => "at top level".to_string(),
        };
        let expected = match expected {
            "" => String::new(),
            e => format!(" ({e})"),
        };
        let mut location = table;
        location.push(key.to_string());
        Problem {
            text: format!("unknown key `{key}` {place}{expected}"),
            location,
        }
    }

    /// The message, with " (line L, column C)" when the key can be found in `text`.
    pub(super) fn render(&self, text: &str) -> String {
        match locate(text, &self.location) {
            Some(offset) => format!("{} ({})", self.text, line_column(text, offset)),
            None => self.text.clone(),
        }
    }
}

/// A TOML syntax error, on one line, with its position.
pub(super) fn syntax_error(text: &str, error: &toml::de::Error) -> String {
    let message = one_line(error.message());
    match error.span() {
        Some(span) => {
            let key = key_of_value_at(text, span.start)
                .map(|k| format!(" in the value of `{k}`"))
                .unwrap_or_default();
            format!(
                "TOML syntax error{key}: {message} ({})",
                line_column(text, span.start)
            )
        }
        None => format!("TOML syntax error: {message}"),
    }
}

/// The key whose value holds byte `offset` of `text`, when that line reads `key = value` and
/// the offset is in the value (a number too large, say): the error then names the key.
fn key_of_value_at(text: &str, offset: usize) -> Option<&str> {
    let offset = offset.min(text.len());
    let start = text[..offset].rfind('\n').map_or(0, |i| i + 1);
    let end = text[start..].find('\n').map_or(text.len(), |i| start + i);
    let line = &text[start..end];
    let eq = line.find('=')?;
    let key = line[..eq].trim();
    let bare = !key.is_empty()
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
    (bare && offset > start + eq).then_some(key)
}

/// A schema error (unknown key, wrong type, bad value) from deserializing `table`, parsed from
/// `text`, rendered on one line naming the key.
pub(super) fn schema_error(text: &str, table: &toml::Table, error: &toml::de::Error) -> String {
    let (mut path, mut message) = split_error(table, error);
    // The key path of an array element carries no index; find the failing `[[hooks]]` entry
    // by checking each one alone, and take the path within it from that error.
    if path.first().map(String::as_str) == Some("hooks")
        && let Some(toml::Value::Array(hooks)) = table.get("hooks")
    {
        for (index, hook) in hooks.iter().enumerate() {
            if let Err(e) = HookConfig::deserialize(hook.clone()) {
                let (inner, inner_message) = match hook {
                    toml::Value::Table(t) => split_error(t, &e),
                    _ => (Vec::new(), e.message().to_string()),
                };
                path = vec!["hooks".to_string(), index.to_string()];
                path.extend(inner);
                message = inner_message;
                break;
            }
        }
    }
    let problem = match parse_unknown_field(&message) {
        Some((key, expected)) => Problem::unknown_key(path, key, &expected),
        None => {
            let path: Vec<&str> = path.iter().map(String::as_str).collect();
            Problem::at(&path, plain_words(&message))
        }
    };
    problem.render(text)
}

/// The key path and the bare message of an error from deserializing a `toml::Value`, whose
/// `Display` is the message followed by "in `a.b.c`" (toml 0.8 keeps the path private). Should
/// that format change, the path comes back empty and the message still says what is wrong;
/// `tests/config_errors.rs` would notice the missing key names.
fn split_error(table: &toml::Table, error: &toml::de::Error) -> (Vec<String>, String) {
    let message = error.message().to_string();
    let shown = error.to_string();
    let dotted = shown
        .strip_prefix(message.as_str())
        .map(str::trim)
        .and_then(|rest| rest.strip_prefix("in `"))
        .and_then(|rest| rest.strip_suffix('`'));
    let path = match dotted {
        Some(dotted) => split_dotted(table, dotted),
        None => Vec::new(),
    };
    (path, one_line(&message))
}

/// Splits "assignees.my.agent.command" into keys. The join is ambiguous when a key contains a
/// dot, so table keys that exist are matched first (longest wins).
fn split_dotted(table: &toml::Table, dotted: &str) -> Vec<String> {
    let mut path = Vec::new();
    let mut rest = dotted;
    let mut current = Some(table);
    while !rest.is_empty() {
        let known = current.into_iter().flat_map(|t| t.keys()).filter(|k| {
            rest == k.as_str()
                || rest
                    .strip_prefix(k.as_str())
                    .is_some_and(|r| r.starts_with('.'))
        });
        let key = match known.max_by_key(|k| k.len()) {
            Some(k) => k.clone(),
            None => rest.split('.').next().unwrap_or(rest).to_string(),
        };
        rest = rest[key.len()..].strip_prefix('.').unwrap_or("");
        current = current
            .and_then(|t| t.get(&key))
            .and_then(toml::Value::as_table);
        path.push(key);
    }
    path
}

/// `("foo", "expected one of `a`, `b`")` from serde's "unknown field `foo`, expected one of …".
fn parse_unknown_field(message: &str) -> Option<(&str, String)> {
    let rest = message.strip_prefix("unknown field `")?;
    let (key, rest) = rest.split_once('`')?;
    let expected = rest.trim_start_matches(',').trim();
    let expected = if expected.starts_with("expected") {
        expected.to_string()
    } else {
        String::new() // "there are no fields"
    };
    Some((key, expected))
}

/// serde's vocabulary turned into a config file's: "u32" means nothing to a user.
fn plain_words(message: &str) -> String {
    let mut out = message
        .replace("unknown variant", "unknown value")
        .replace("missing field", "missing key")
        .replace("expected u32", "expected a non-negative integer")
        .replace("expected u64", "expected a non-negative integer")
        .replace("expected i32", "expected a 32-bit integer")
        .replace("expected a sequence", "expected an array")
        .replace("expected a map", "expected a table");
    if let Some(at) = out.find("expected struct ") {
        out.truncate(at);
        out.push_str("expected a table");
    }
    out
}

/// Several lines of toml's message as one.
fn one_line(message: &str) -> String {
    let lines: Vec<&str> = message
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    lines.join("; ")
}

/// How a key path is shown: "[supervisor] tick", "[assignees.coder] env.HOME", "[[hooks]] #2 on".
fn describe(path: &[String]) -> Option<String> {
    let (first, rest) = path.split_first()?;
    let (section, keys) = match (first.as_str(), rest) {
        ("assignees", [name, keys @ ..]) => (format!("[assignees.{}]", quote_key(name)), keys),
        ("hooks", [index, keys @ ..]) if index.parse::<usize>().is_ok() => {
            let number = index.parse::<usize>().unwrap_or(0) + 1;
            (format!("[[hooks]] #{number}"), keys)
        }
        ("hooks", keys) => ("[[hooks]]".to_string(), keys),
        (section, keys) => (format!("[{}]", quote_key(section)), keys),
    };
    if keys.is_empty() {
        return Some(section);
    }
    let keys: Vec<String> = keys.iter().map(|k| quote_key(k)).collect();
    Some(format!("{section} {}", keys.join(".")))
}

/// A key as TOML would need it written: bare when it can be, quoted otherwise.
pub(super) fn quote_key(key: &str) -> String {
    if is_bare_key(key) {
        key.to_string()
    } else {
        format!("{key:?}")
    }
}

/// TOML's bare keys, which are also the accepted assignee names: `[A-Za-z0-9_-]+`.
pub(super) fn is_bare_key(key: &str) -> bool {
    !key.is_empty()
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// "line L, column C" of byte `offset` in `text` (both 1-based; columns count characters).
fn line_column(text: &str, offset: usize) -> String {
    let offset = offset.min(text.len());
    let before = text.get(..offset).unwrap_or(text);
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let column = before[line_start..].chars().count() + 1;
    format!("line {line}, column {column}")
}

/// The byte offset of the key at `path` in `text` — or of the deepest part of the path that
/// exists (a missing key is reported at its table's key). `None` if the text cannot be walked.
fn locate(text: &str, path: &[String]) -> Option<usize> {
    let root: Node = toml::from_str(text).ok()?;
    let mut node = &root;
    let mut found = None;
    for key in path {
        let (start, next) = match node {
            Node::Table(entries) => match entries.get(key.as_str()) {
                Some((start, next)) => (Some(*start), next),
                None => break,
            },
            // Array elements have no key of their own: an element that is a table (a
            // `[[hooks]]` entry) is placed at its first key, anything else at the array's key.
            Node::Array(items) => match key.parse::<usize>().ok().and_then(|i| items.get(i)) {
                Some(item @ Node::Table(entries)) => {
                    (entries.values().map(|(start, _)| *start).min(), item)
                }
                Some(item) => (None, item),
                None => break,
            },
            Node::Leaf => break,
        };
        found = start.or(found);
        node = next;
    }
    found
}

/// A TOML document reduced to its shape, with where each key starts. Keys are what carry the
/// spans: toml gives none for an implicit table (`assignees` in `[assignees.coder]`), but its
/// key still has a position.
enum Node {
    Table(BTreeMap<String, (usize, Node)>),
    Array(Vec<Node>),
    Leaf,
}

impl<'de> Deserialize<'de> for Node {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Node, D::Error> {
        d.deserialize_any(NodeVisitor)
    }
}

struct NodeVisitor;

impl<'de> Visitor<'de> for NodeVisitor {
    type Value = Node;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any TOML value")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Node, A::Error> {
        let mut entries = BTreeMap::new();
        while let Some(key) = map.next_key::<Spanned<String>>()? {
            let start = key.span().start;
            entries.insert(key.into_inner(), (start, map.next_value::<Node>()?));
        }
        Ok(Node::Table(entries))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Node, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element::<Node>()? {
            items.push(item);
        }
        Ok(Node::Array(items))
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Node, E> {
        Ok(Node::Leaf)
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Node, E> {
        Ok(Node::Leaf)
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Node, E> {
        Ok(Node::Leaf)
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Node, E> {
        Ok(Node::Leaf)
    }

    fn visit_str<E: de::Error>(self, _: &str) -> Result<Node, E> {
        Ok(Node::Leaf)
    }
}
