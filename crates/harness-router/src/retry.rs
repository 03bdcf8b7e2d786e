//! Retrying a request that failed before any output was streamed.
//!
//! Only the start of a generation is retried here: once a frame with content reached the loop, a
//! retry would show the user the same words twice, so a failure after output goes to the loop's
//! recovery budget instead (it resumes from the partial reply). Waits honour the provider's
//! `retry-after` (seconds or an HTTP date; OpenAI's `retry-after-ms` too), otherwise back off
//! exponentially with jitter; attempts and the total wait are bounded, and an abort ends a wait.

use std::hash::{BuildHasher, Hasher};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use reqwest::header::HeaderMap;
use serde::{Deserialize, Serialize};

/// How a provider retries the start of a generation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RetryPolicy {
    /// Attempts in all (1 = never retry).
    pub max_attempts: u32,
    pub base_delay_ms: u64,
    pub max_delay_ms: u64,
    /// A wait that would push the total past this gives up at once (a `retry-after` of a minute
    /// is better reported than slept through).
    pub max_total_wait_ms: u64,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 3,
            base_delay_ms: 500,
            max_delay_ms: 8_000,
            max_total_wait_ms: 30_000,
        }
    }
}

impl RetryPolicy {
    /// For a server on this machine (the local presets): loading a model takes seconds (~10 s
    /// for a small one), and until then the server refuses connections or answers 503, so the
    /// start is retried for long enough to wait it out (at least ~12 s with the jitter).
    pub fn local() -> Self {
        RetryPolicy {
            max_attempts: 8,
            base_delay_ms: 500,
            max_delay_ms: 6_000,
            max_total_wait_ms: 45_000,
        }
    }

    /// The wait after failed attempt number `attempt` (1-based).
    pub fn delay(&self, attempt: u32, retry_after: Option<Duration>) -> Duration {
        if let Some(d) = retry_after {
            return d;
        }
        let exp = self
            .base_delay_ms
            .saturating_mul(1u64 << attempt.saturating_sub(1).min(20));
        let capped = exp.min(self.max_delay_ms);
        // Jitter in [50%, 100%]: clients that failed together do not retry together.
        let jitter = 0.5 + 0.5 * unit_random();
        Duration::from_millis((capped as f64 * jitter) as u64)
    }
}

/// A number in [0, 1) that differs between calls (no RNG dependency needed for jitter).
fn unit_random() -> f64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    (h.finish() >> 11) as f64 / (1u64 << 53) as f64
}

/// The wait a response asks for: `retry-after-ms`, else `retry-after` in seconds or as an HTTP
/// date (relative to `now`).
pub fn retry_after(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let text = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
    };
    if let Some(ms) = text("retry-after-ms").and_then(|v| v.parse::<f64>().ok()) {
        if ms.is_finite() && ms >= 0.0 {
            return Some(Duration::from_micros((ms * 1000.0) as u64));
        }
    }
    let v = text("retry-after")?;
    if let Ok(secs) = v.parse::<f64>() {
        return (secs.is_finite() && secs >= 0.0).then(|| Duration::from_secs_f64(secs));
    }
    let at = parse_http_date(v)?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

/// Parses an IMF-fixdate (`Sun, 06 Nov 1994 08:49:37 GMT`), the only form RFC 9110 lets
/// senders use.
pub fn parse_http_date(s: &str) -> Option<SystemTime> {
    let rest = s.split_once(", ")?.1;
    let parts: Vec<&str> = rest.split(' ').collect();
    let [day, month, year, time, "GMT"] = parts.as_slice() else {
        return None;
    };
    let day: u32 = day.parse().ok()?;
    let month = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ]
    .iter()
    .position(|m| m == month)? as u32
        + 1;
    let year: i64 = year.parse().ok()?;
    let hms: Vec<u64> = time
        .split(':')
        .map(|x| x.parse().ok())
        .collect::<Option<_>>()?;
    let [h, m, sec] = hms.as_slice() else {
        return None;
    };
    if !(1..=31).contains(&day) || *h > 23 || *m > 59 || *sec > 60 {
        return None;
    }
    let days = days_from_civil(year, month, day);
    let secs = days.checked_mul(86_400)? + (*h * 3600 + *m * 60 + *sec) as i64;
    Some(UNIX_EPOCH + Duration::from_secs(u64::try_from(secs).ok()?))
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let m = m as i64;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + d as i64 - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;
    use reqwest::header::HeaderValue;

    #[test]
    fn retry_after_reads_seconds_dates_and_milliseconds() {
        let now = UNIX_EPOCH + Duration::from_secs(784_111_770); // Sun, 06 Nov 1994 08:49:30 GMT
        let mut h = HeaderMap::new();
        assert_eq!(retry_after(&h, now), None);
        h.insert("retry-after", HeaderValue::from_static("2"));
        assert_eq!(retry_after(&h, now), Some(Duration::from_secs(2)));
        h.insert(
            "retry-after",
            HeaderValue::from_static("Sun, 06 Nov 1994 08:49:37 GMT"),
        );
        assert_eq!(retry_after(&h, now), Some(Duration::from_secs(7)));
        h.insert("retry-after-ms", HeaderValue::from_static("150"));
        assert_eq!(retry_after(&h, now), Some(Duration::from_millis(150)));
        h.remove("retry-after-ms");
        h.insert("retry-after", HeaderValue::from_static("soon"));
        assert_eq!(retry_after(&h, now), None);
    }

    #[test]
    fn backoff_grows_is_capped_and_jittered() {
        let p = RetryPolicy {
            base_delay_ms: 100,
            max_delay_ms: 300,
            ..RetryPolicy::default()
        };
        let d1 = p.delay(1, None).as_millis();
        let d3 = p.delay(3, None).as_millis();
        assert!((50..=100).contains(&d1), "{d1}");
        assert!((150..=300).contains(&d3), "{d3}");
        assert_eq!(
            p.delay(1, Some(Duration::from_secs(4))),
            Duration::from_secs(4)
        );
    }
}
