//! The host's log: one line per event on stderr, `time LEVEL target: message key=value …`.
//!
//! A `tracing` subscriber of its own rather than `tracing-subscriber`'s formatter: the host
//! records no spans and needs no layers, and the formatter's registry machinery cost more of the
//! host's size budget than the whole of this file.

use std::{fmt::Write as _, io::Write as _, str::FromStr};
use tracing::{
    Event, Level, Metadata, Subscriber,
    field::{Field, Visit},
    level_filters::LevelFilter,
    span::{Attributes, Id, Record},
};

/// Which events are written: a default level and per-target levels (`RUST_LOG` syntax
/// `level` or `target=level,...`; the longest matching target prefix wins).
pub struct StderrLog {
    default: LevelFilter,
    targets: Vec<(String, LevelFilter)>,
}

impl StderrLog {
    /// A log at `default` level, refined by `spec` (`RUST_LOG`) when it parses.
    pub fn new(default: Level, spec: Option<&str>) -> Self {
        let fallback = Self {
            default: LevelFilter::from_level(default),
            targets: Vec::new(),
        };
        spec.and_then(Self::parse).unwrap_or(fallback)
    }

    fn parse(spec: &str) -> Option<Self> {
        let mut log = Self {
            default: LevelFilter::OFF,
            targets: Vec::new(),
        };
        for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            match part.split_once('=') {
                Some((target, level)) => log
                    .targets
                    .push((target.to_string(), LevelFilter::from_str(level).ok()?)),
                None => log.default = LevelFilter::from_str(part).ok()?,
            }
        }
        Some(log)
    }

    fn level_for(&self, target: &str) -> LevelFilter {
        self.targets
            .iter()
            .filter(|(prefix, _)| target.starts_with(prefix.as_str()))
            .max_by_key(|(prefix, _)| prefix.len())
            .map_or(self.default, |(_, level)| *level)
    }
}

impl Subscriber for StderrLog {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        *metadata.level() <= self.level_for(metadata.target())
    }

    fn max_level_hint(&self) -> Option<LevelFilter> {
        self.targets
            .iter()
            .map(|(_, level)| *level)
            .chain([self.default])
            .max()
    }

    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }

    fn record(&self, _: &Id, _: &Record<'_>) {}

    fn record_follows_from(&self, _: &Id, _: &Id) {}

    fn event(&self, event: &Event<'_>) {
        let meta = event.metadata();
        let mut line = timestamp();
        let _ = write!(line, " {:>5} {}:", meta.level(), meta.target());
        event.record(&mut Fields(&mut line));
        line.push('\n');
        // One write per line, so lines of concurrent threads do not interleave.
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
    }

    fn enter(&self, _: &Id) {}

    fn exit(&self, _: &Id) {}
}

/// Appends an event's message, then its other fields as ` key=value`.
struct Fields<'a>(&'a mut String);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        let _ = match field.name() {
            "message" => write!(self.0, " {value:?}"),
            name => write!(self.0, " {name}={value:?}"),
        };
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        let _ = match field.name() {
            "message" => write!(self.0, " {value}"),
            name => write!(self.0, " {name}={value:?}"),
        };
    }
}

/// Now in UTC, RFC 3339 with microseconds (`2026-12-07T05:50:00.123456Z`).
fn timestamp() -> String {
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let secs = since.as_secs();
    let (days, day_secs) = (secs / 86_400, secs % 86_400);
    let (year, month, day) = civil_date(days as i64);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:06}Z",
        day_secs / 3600,
        day_secs / 60 % 60,
        day_secs % 60,
        since.subsec_micros()
    )
}

/// The proleptic Gregorian date `days` after 1970-01-01 (Howard Hinnant's days-to-civil).
fn civil_date(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_follow_the_gregorian_calendar() {
        assert_eq!(civil_date(0), (1970, 1, 1));
        assert_eq!(civil_date(11_016), (2000, 2, 29));
        assert_eq!(civil_date(20_794), (2026, 12, 7));
        assert_eq!(civil_date(-1), (1969, 12, 31));
    }

    #[test]
    fn the_longest_matching_target_decides() {
        let log = StderrLog::new(
            Level::ERROR,
            Some("info,u_runner::serve=debug,u_runner=warn"),
        );
        assert_eq!(log.level_for("u_runner::serve"), LevelFilter::DEBUG);
        assert_eq!(log.level_for("u_runner::loading"), LevelFilter::WARN);
        assert_eq!(log.level_for("other"), LevelFilter::INFO);
        assert_eq!(log.max_level_hint(), Some(LevelFilter::DEBUG));
    }

    #[test]
    fn an_unparsable_spec_keeps_the_default() {
        let log = StderrLog::new(Level::ERROR, Some("u_runner=loud"));
        assert_eq!(log.level_for("u_runner"), LevelFilter::ERROR);
    }
}
