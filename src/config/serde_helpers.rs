//! Value formats of `config.toml` that serde does not provide: humantime durations, the umask and
//! resource limits. Each error message says what was expected; the key is added by the caller.

use std::fmt;
use std::time::Duration;

use serde::de::{self, Deserializer, Visitor};
use serde::ser::Serializer;

/// What a duration looks like, for error messages.
const DURATION_EXAMPLES: &str = "a duration such as \"500ms\", \"30s\", \"2m\" or \"1h 30m\"";

/// The longest duration a config accepts: 100 years (humantime's year, 365.25 days), so "100y"
/// is fine. Anything longer is surely a typo, and would overflow `Instant::now() + d`.
pub(super) const MAX_DURATION: Duration = Duration::from_secs(100 * 31_557_600);

fn parse_duration<E: de::Error>(s: &str) -> Result<Duration, E> {
    let d = humantime::parse_duration(s.trim()).map_err(|e| {
        E::custom(format!(
            "invalid duration {s:?} ({e}); expected {DURATION_EXAMPLES}"
        ))
    })?;
    if d > MAX_DURATION {
        return Err(E::custom(format!("too long (max 100 years): {s:?}")));
    }
    Ok(d)
}

struct DurationVisitor;

impl Visitor<'_> for DurationVisitor {
    type Value = Duration;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(DURATION_EXAMPLES)
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<Duration, E> {
        parse_duration(s)
    }
}

/// `Duration` as a humantime string (`"2m"`).
pub(super) mod duration {
    use super::*;

    pub(in crate::config) fn serialize<S: Serializer>(
        d: &Duration,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.collect_str(&humantime::format_duration(*d))
    }

    pub(in crate::config) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Duration, D::Error> {
        d.deserialize_str(DurationVisitor)
    }
}

/// `Option<Duration>` as a humantime string; absent is `None`.
pub(super) mod opt_duration {
    use super::*;

    pub(in crate::config) fn serialize<S: Serializer>(
        d: &Option<Duration>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => s.collect_str(&humantime::format_duration(*d)),
            None => s.serialize_none(),
        }
    }

    pub(in crate::config) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<Duration>, D::Error> {
        // A present key is always a value in TOML (there is no null), so no Option visitor.
        d.deserialize_str(DurationVisitor).map(Some)
    }
}

/// The umask: a string of octal digits (`"022"`, `"0o022"`) or an integer (`0o022` in TOML).
pub(super) mod umask {
    use super::*;

    struct UmaskVisitor;

    fn check<E: de::Error>(value: u64, written: &dyn fmt::Display) -> Result<Option<u32>, E> {
        if value > 0o777 {
            return Err(E::custom(format!(
                "umask {written} is out of range; expected at most 0o777 (\"777\")"
            )));
        }
        Ok(Some(value as u32))
    }

    impl Visitor<'_> for UmaskVisitor {
        type Value = Option<u32>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("octal digits such as \"022\", or an integer such as 0o022")
        }

        fn visit_str<E: de::Error>(self, s: &str) -> Result<Option<u32>, E> {
            let digits = s.strip_prefix("0o").unwrap_or(s);
            let octal = !digits.is_empty() && digits.len() <= 4;
            match u64::from_str_radix(digits, 8) {
                Ok(value) if octal => check(value, &format_args!("{s:?}")),
                _ => Err(E::custom(format!(
                    "invalid umask {s:?}; expected octal digits such as \"022\" or \"077\""
                ))),
            }
        }

        fn visit_i64<E: de::Error>(self, v: i64) -> Result<Option<u32>, E> {
            match u64::try_from(v) {
                Ok(value) => check(value, &format_args!("{v:#o}")),
                Err(_) => Err(E::custom(format!("umask {v} is negative"))),
            }
        }

        fn visit_u64<E: de::Error>(self, v: u64) -> Result<Option<u32>, E> {
            check(v, &format_args!("{v:#o}"))
        }
    }

    pub(in crate::config) fn serialize<S: Serializer>(
        m: &Option<u32>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        match m {
            Some(m) => s.collect_str(&format_args!("{m:03o}")),
            None => s.serialize_none(),
        }
    }

    pub(in crate::config) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<u32>, D::Error> {
        d.deserialize_any(UmaskVisitor)
    }
}

/// A user or group: a name, or a numeric id written as a string (`"1000"`) or a TOML integer
/// (`1000`), kept as the string the lookup takes.
pub(super) mod name_or_id {
    use super::*;

    struct NameOrIdVisitor;

    impl Visitor<'_> for NameOrIdVisitor {
        type Value = Option<String>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a name, or a numeric id such as 1000")
        }

        fn visit_str<E: de::Error>(self, s: &str) -> Result<Option<String>, E> {
            Ok(Some(s.to_string()))
        }

        fn visit_i64<E: de::Error>(self, v: i64) -> Result<Option<String>, E> {
            match u32::try_from(v) {
                Ok(id) => Ok(Some(id.to_string())),
                Err(_) => Err(E::custom(format!(
                    "id {v} is out of range; expected 0 to {}",
                    u32::MAX
                ))),
            }
        }

        fn visit_u64<E: de::Error>(self, v: u64) -> Result<Option<String>, E> {
            self.visit_i64(i64::try_from(v).unwrap_or(-1))
        }
    }

    pub(in crate::config) fn serialize<S: Serializer>(
        v: &Option<String>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        match v {
            Some(v) => s.serialize_str(v),
            None => s.serialize_none(),
        }
    }

    pub(in crate::config) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<String>, D::Error> {
        d.deserialize_any(NameOrIdVisitor)
    }
}

/// Resource limits: name → integer, or `"unlimited"` (stored as `u64::MAX`, `RLIM_INFINITY`).
/// The names are checked by validation, which can name the offending entry.
pub(super) mod rlimits {
    use std::collections::BTreeMap;

    use serde::{Deserialize, Serialize};

    use super::*;

    /// One limit value as written.
    struct Limit(u64);

    struct LimitVisitor;

    impl Visitor<'_> for LimitVisitor {
        type Value = Limit;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a non-negative integer or \"unlimited\"")
        }

        fn visit_str<E: de::Error>(self, s: &str) -> Result<Limit, E> {
            match s {
                "unlimited" | "infinity" => Ok(Limit(u64::MAX)),
                _ => Err(E::custom(format!(
                    "invalid limit {s:?}; expected a non-negative integer or \"unlimited\""
                ))),
            }
        }

        fn visit_i64<E: de::Error>(self, v: i64) -> Result<Limit, E> {
            u64::try_from(v).map(Limit).map_err(|_| {
                E::custom(format!(
                    "invalid limit {v}; expected a non-negative integer or \"unlimited\""
                ))
            })
        }

        fn visit_u64<E: de::Error>(self, v: u64) -> Result<Limit, E> {
            Ok(Limit(v))
        }
    }

    impl<'de> Deserialize<'de> for Limit {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Limit, D::Error> {
            d.deserialize_any(LimitVisitor)
        }
    }

    /// Serialized form: the number, or "unlimited" for `RLIM_INFINITY` (which TOML cannot hold).
    #[derive(Serialize)]
    #[serde(untagged)]
    enum Written<'a> {
        Unlimited(&'a str),
        Value(u64),
    }

    pub(in crate::config) fn serialize<S: Serializer>(
        m: &BTreeMap<String, u64>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.collect_map(m.iter().map(|(name, &value)| {
            let written = if value == u64::MAX {
                Written::Unlimited("unlimited")
            } else {
                Written::Value(value)
            };
            (name, written)
        }))
    }

    pub(in crate::config) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<BTreeMap<String, u64>, D::Error> {
        let written = BTreeMap::<String, Limit>::deserialize(d)?;
        Ok(written.into_iter().map(|(k, Limit(v))| (k, v)).collect())
    }
}
