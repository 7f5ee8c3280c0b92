//! Schedules: when a cron fires, and which jobs a firing creates. Pure: no
//! SQL here (see [`crate::store::schedules`]).
//!
//! A schedule's `cron` has five fields (minute hour day-of-month month
//! day-of-week), or six with seconds first, read by the maintained
//! [`croner`] parser in an IANA `timezone` (UTC by default). Each fire time
//! creates the job `{schedule id}:{fire time in UTC as YYYYMMDDTHHMMSSZ}`,
//! so a fire time is one job whatever the nodes or the crashes. What
//! happens to fire times missed while no node ran is the schedule's
//! `catch_up`.

use chrono::{DateTime, Utc};
use croner::parser::{CronParser, Seconds, Year};
use croner::Cron;

use crate::error::InvalidInput;

/// Longest schedule id (its jobs' ids add 17 characters).
pub const MAX_SCHEDULE_ID: usize = 150;

/// How late a fire time may be and still fire under `catch_up: "none"`:
/// later than this, it was missed (no node ran then).
pub const ON_TIME: chrono::Duration = chrono::Duration::seconds(60);

/// Most fire times one firing creates for one schedule (`catch_up: "all"`
/// after a long outage goes on at the next firing).
pub const MAX_FIRES_AT_ONCE: usize = 100;

/// What happens to fire times missed while no node ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CatchUp {
    /// Only the latest missed fire time fires (the default).
    Latest,
    /// Every missed fire time fires, oldest first.
    All,
    /// None fires: only a fire time reached while a node runs does.
    None,
}

impl CatchUp {
    /// The stored and shown name.
    pub fn as_str(self) -> &'static str {
        match self {
            CatchUp::Latest => "latest",
            CatchUp::All => "all",
            CatchUp::None => "none",
        }
    }

    /// Parses a stored or submitted name.
    pub fn parse(s: &str) -> Option<CatchUp> {
        match s {
            "latest" => Some(CatchUp::Latest),
            "all" => Some(CatchUp::All),
            "none" => Some(CatchUp::None),
            _ => None,
        }
    }
}

/// A parsed cron in its time zone.
#[derive(Debug, Clone)]
pub struct Timetable {
    cron: Cron,
    tz: chrono_tz::Tz,
}

impl Timetable {
    /// Parses `cron` (five fields, or six with seconds first) in IANA
    /// zone `timezone`; a bad one is an error naming the field.
    pub fn parse(cron: &str, timezone: &str) -> Result<Timetable, InvalidInput> {
        let fields = cron.split_whitespace().count();
        if !(fields == 5 || fields == 6) {
            return Err(InvalidInput::new(
                "cron",
                format!("must have 5 fields (minute hour day-of-month month day-of-week), or 6 with seconds first; got {fields}"),
            ));
        }
        let parser = CronParser::builder()
            .seconds(Seconds::Optional)
            .year(Year::Disallowed)
            .build();
        let cron = parser
            .parse(cron)
            .map_err(|e| InvalidInput::new("cron", format!("is not a cron expression: {e}")))?;
        let tz: chrono_tz::Tz = timezone.parse().map_err(|_| {
            InvalidInput::new(
                "timezone",
                "must be an IANA time zone name (e.g. Europe/Paris, UTC)",
            )
        })?;
        let table = Timetable { cron, tz };
        if table.next_after(Utc::now()).is_none() {
            return Err(InvalidInput::new("cron", "never fires"));
        }
        Ok(table)
    }

    /// The shortest time between two of the next `times + 1` fire times
    /// after `from` (`None`: it fires once at most).
    pub fn shortest_gap(&self, from: DateTime<Utc>, times: usize) -> Option<chrono::Duration> {
        let mut at = self.next_after(from)?;
        let mut shortest: Option<chrono::Duration> = None;
        for _ in 0..times {
            let Some(next) = self.next_after(at) else {
                break;
            };
            let gap = next - at;
            shortest = Some(shortest.map_or(gap, |s| s.min(gap)));
            at = next;
        }
        shortest
    }

    /// The first fire time strictly after `t`, or `None` when there is none.
    pub fn next_after(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        self.cron
            .find_next_occurrence(&t.with_timezone(&self.tz), false)
            .ok()
            .map(|at| at.with_timezone(&Utc))
    }

    /// The last fire time at or before `t`, or `None`.
    pub fn last_at_or_before(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        self.cron
            .find_previous_occurrence(&t.with_timezone(&self.tz), true)
            .ok()
            .map(|at| at.with_timezone(&Utc))
    }

    /// The fire times from `from` (included, the schedule's next fire time)
    /// to `now` that fire under `catch_up`, and the schedule's next fire
    /// time after them. Bounded work whatever the outage: `all` fires at
    /// most [`MAX_FIRES_AT_ONCE`] (the rest at the next firing); `latest`
    /// and `none` look only at the last fire time before `now`.
    pub fn due(
        &self,
        from: DateTime<Utc>,
        now: DateTime<Utc>,
        catch_up: CatchUp,
    ) -> (Vec<DateTime<Utc>>, Option<DateTime<Utc>>) {
        if from > now {
            return (Vec::new(), Some(from));
        }
        match catch_up {
            CatchUp::All => {
                let mut times = Vec::new();
                let mut t = Some(from);
                while let Some(at) = t.filter(|at| *at <= now) {
                    if times.len() == MAX_FIRES_AT_ONCE {
                        return (times, Some(at)); // the rest at the next firing
                    }
                    times.push(at);
                    t = self.next_after(at);
                }
                (times, t)
            }
            CatchUp::Latest | CatchUp::None => {
                let last = self
                    .last_at_or_before(now)
                    .filter(|at| *at >= from)
                    .unwrap_or(from);
                let fire = catch_up == CatchUp::Latest || now - last <= ON_TIME;
                (
                    if fire { vec![last] } else { Vec::new() },
                    self.next_after(now.max(last)),
                )
            }
        }
    }
}

/// The id of the job schedule `schedule_id` creates for fire time `at`.
pub fn job_id(schedule_id: &str, at: DateTime<Utc>) -> String {
    format!("{schedule_id}:{}", at.format("%Y%m%dT%H%M%SZ"))
}

/// Whether job id `id` has the form of a schedule's job,
/// `{schedule id}:{YYYYMMDDTHHMMSSZ}`: intake refuses such ids, so no job
/// submitted by hand can take a fire time's place.
pub fn is_scheduled_job_id(id: &str) -> bool {
    let Some((schedule, stamp)) = id.rsplit_once(':') else {
        return false;
    };
    validate_id(schedule).is_ok()
        && stamp.len() == 16
        && chrono::NaiveDateTime::parse_from_str(stamp, "%Y%m%dT%H%M%SZ").is_ok()
}

/// Whether `id` may name a schedule: 1–150 characters of `A-Z a-z 0-9 _ . -`.
pub fn validate_id(id: &str) -> Result<(), InvalidInput> {
    if id.is_empty() || id.len() > MAX_SCHEDULE_ID {
        return Err(InvalidInput::new(
            "id",
            format!("must be 1 to {MAX_SCHEDULE_ID} characters long"),
        ));
    }
    if let Some(bad) = id
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-')))
    {
        return Err(InvalidInput::new(
            "id",
            format!("may contain only A-Z a-z 0-9 _ . - (found {bad:?})"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn at(h: u32, m: u32, s: u32) -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 12, 4, h, m, s).unwrap()
    }

    #[test]
    fn five_or_six_fields_in_a_time_zone() {
        let daily = Timetable::parse("0 2 * * *", "UTC").unwrap();
        assert_eq!(daily.next_after(at(1, 0, 0)), Some(at(2, 0, 0)));
        assert_eq!(
            daily.next_after(at(2, 0, 0)),
            Some(at(2, 0, 0) + chrono::Duration::days(1))
        );
        let seconds = Timetable::parse("*/10 * * * * *", "UTC").unwrap();
        assert_eq!(seconds.next_after(at(2, 0, 0)), Some(at(2, 0, 10)));
        // 02:00 in Paris is 01:00 UTC in December.
        let paris = Timetable::parse("0 2 * * *", "Europe/Paris").unwrap();
        assert_eq!(paris.next_after(at(0, 0, 0)), Some(at(1, 0, 0)));
    }

    #[test]
    fn bad_crons_and_zones_name_their_field() {
        for (cron, tz, field) in [
            ("0 2 * *", "UTC", "cron"),
            ("0 0 2 * * * 2027", "UTC", "cron"),
            ("61 * * * *", "UTC", "cron"),
            ("every day", "UTC", "cron"),
            ("0 2 * * *", "Mars/Olympus", "timezone"),
        ] {
            let e = Timetable::parse(cron, tz).unwrap_err();
            assert_eq!(e.field, field, "{cron} {tz}: {e}");
        }
    }

    #[test]
    fn catch_up_fires_the_latest_all_or_none_of_the_missed_times() {
        let hourly = Timetable::parse("0 * * * *", "UTC").unwrap();
        let now = at(5, 30, 0);
        let (all, next) = hourly.due(at(2, 0, 0), now, CatchUp::All);
        assert_eq!(
            all,
            vec![at(2, 0, 0), at(3, 0, 0), at(4, 0, 0), at(5, 0, 0)]
        );
        assert_eq!(next, Some(at(6, 0, 0)));
        let (latest, next) = hourly.due(at(2, 0, 0), now, CatchUp::Latest);
        assert_eq!((latest, next), (vec![at(5, 0, 0)], Some(at(6, 0, 0))));
        let (none, next) = hourly.due(at(2, 0, 0), now, CatchUp::None);
        assert_eq!((none, next), (vec![], Some(at(6, 0, 0))));
        // On time (within a minute), "none" fires it.
        let (on_time, _) = hourly.due(at(5, 0, 0), at(5, 0, 1), CatchUp::None);
        assert_eq!(on_time, vec![at(5, 0, 0)]);
        // The edge: 60 s late still fires, 61 s late is missed.
        let (edge, _) = hourly.due(at(5, 0, 0), at(5, 1, 0), CatchUp::None);
        assert_eq!(edge, vec![at(5, 0, 0)], "60 s late fires");
        let (late, next) = hourly.due(at(5, 0, 0), at(5, 1, 1), CatchUp::None);
        assert_eq!(
            (late, next),
            (vec![], Some(at(6, 0, 0))),
            "61 s late is missed"
        );
        // Not due yet: nothing, and the next time stays.
        assert_eq!(
            hourly.due(at(6, 0, 0), now, CatchUp::All),
            (vec![], Some(at(6, 0, 0)))
        );
    }

    #[test]
    fn a_long_outage_under_all_fires_in_bounded_steps() {
        let secondly = Timetable::parse("* * * * * *", "UTC").unwrap();
        let (first, next) = secondly.due(at(0, 0, 0), at(1, 0, 0), CatchUp::All);
        assert_eq!(first.len(), MAX_FIRES_AT_ONCE);
        assert_eq!(
            next,
            Some(at(0, 0, 0) + chrono::Duration::seconds(MAX_FIRES_AT_ONCE as i64))
        );
    }

    #[test]
    fn job_ids_name_the_fire_time_in_utc() {
        assert_eq!(job_id("digest", at(2, 0, 0)), "digest:20261204T020000Z");
        assert!(validate_id("digest-1.a_b").is_ok());
        assert_eq!(validate_id("a:b").unwrap_err().field, "id");
        assert_eq!(validate_id("").unwrap_err().field, "id");
        assert!(is_scheduled_job_id("digest:20261204T020000Z"));
        assert!(
            !is_scheduled_job_id("a:b:20261204T020000Z"),
            "a schedule id has no colon"
        );
        assert!(
            !is_scheduled_job_id("digest:20261304T020000Z"),
            "no 13th month"
        );
        assert!(!is_scheduled_job_id("order-7"));
    }
}
