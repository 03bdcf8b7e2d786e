//! `GET /metrics`: the Prometheus text format of a runtime's own registry, checked against a
//! scripted run of known shape (a completed turn with a call, a failed one, a stopped one),
//! parsed line by line; and, when `promtool` is installed, linted by Prometheus's own checker.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::process::{Command, Stdio};

use common::*;
use serde_json::{json, Value};

const USER_TEXT: &str = "check the weather in Trondheim";

fn run_script() -> Value {
    weather_script(
        "Trondheim",
        vec![
            json!({"match": {"last_user_text": "^break"},
                   "error": {"kind": "permanent", "message": "refused"}, "repeat": true}),
            json!({"match": {"last_user_text": "^dawdle"}, "delay_ms": 5000,
                   "content": [{"type": "text", "text": "too late"}]}),
        ],
        "It is sunny.",
    )
}

/// One sample: name, labels, value.
type Sample = (String, BTreeMap<String, String>, f64);

fn parse(body: &str) -> Vec<Sample> {
    let mut out = Vec::new();
    for line in body
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let (series, value) = line.rsplit_once(' ').expect("`series value`");
        let (name, labels) = match series.split_once('{') {
            Some((n, rest)) => {
                let inner = rest.strip_suffix('}').expect("closing brace");
                let labels = inner
                    .split("\",")
                    .filter(|p| !p.is_empty())
                    .map(|p| {
                        let (k, v) = p.split_once("=\"").expect("k=\"v\"");
                        (k.to_string(), v.trim_end_matches('"').to_string())
                    })
                    .collect();
                (n.to_string(), labels)
            }
            None => (series.to_string(), BTreeMap::new()),
        };
        out.push((name, labels, value.parse().expect("a number")));
    }
    out
}

fn value(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> f64 {
    samples
        .iter()
        .filter(|(n, l, _)| {
            n == name
                && labels
                    .iter()
                    .all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|(_, _, v)| v)
        .sum()
}

/// The JSON answer to `request`, or `None` while nothing (or no JSON) answers it.
async fn json_answer(request: reqwest::RequestBuilder) -> Option<Value> {
    request.send().await.ok()?.json().await.ok()
}

async fn scrape(server: &Server) -> (String, String) {
    let resp = reqwest::get(format!("{}/metrics", server.url()))
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let ct = resp.headers()["content-type"].to_str().unwrap().to_string();
    (ct, resp.text().await.unwrap())
}

/// What the transcripts recorded: generations, input and output tokens.
struct Recorded {
    generations: usize,
    input: f64,
    output: f64,
}

async fn run(server: &Server) -> Recorded {
    let s = server
        .send_and_wait(
            json!({"session_id": "s_metrics_ok", "message": USER_TEXT, "model": "demo", "provider": "scripted",
                   "options": {"functions": {"allow": ["fx::*"], "expose": "native"}}}),
        )
        .await;
    assert_eq!(s["status"], "completed", "{s}");
    let s = server
        .send_and_wait(
            json!({"session_id": "s_metrics_bad", "message": "break it", "model": "demo", "provider": "scripted"}),
        )
        .await;
    assert_eq!(s["status"], "failed", "{s}");
    let (_, stopped_turn) = server
        .start_turn(
            json!({"session_id": "s_metrics_stop", "message": "dawdle", "model": "demo", "provider": "scripted"}),
        )
        .await;
    wait_for("the slow turn to generate", WAIT, || async {
        let s = server.status("s_metrics_stop").await;
        (s["step"].as_u64().is_some() && s["status"] == "running").then_some(())
    })
    .await;
    server
        .ok("harness::stop", json!({"session_id": "s_metrics_stop"}))
        .await;
    let s = server.wait_turn("s_metrics_stop", &stopped_turn).await;
    assert_eq!(s["status"], "cancelled", "{s}");
    let mut r = Recorded {
        generations: 0,
        input: 0.0,
        output: 0.0,
    };
    for sid in ["s_metrics_ok", "s_metrics_bad", "s_metrics_stop"] {
        for e in server.transcript(sid, false).await {
            if e["message"]["role"] == "assistant" {
                r.generations += 1;
                r.input += e["message"]["usage"]["input"].as_f64().unwrap_or(0.0);
                r.output += e["message"]["usage"]["output"].as_f64().unwrap_or(0.0);
            }
        }
    }
    r
}

fn server_args(fx: &Fixtures) -> Vec<String> {
    fx.args()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_the_run_in_closed_label_sets() {
    let fx = Fixtures::new(json!([{"id": "fx::forecast", "response": {"sky": "sunny"}}]));
    let extra = server_args(&fx);
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    let server = Server::start(&run_script(), &extra).await;
    let recorded = run(&server).await;
    // The stopped turn's step ends after its terminal write: poll for it.
    let body = wait_for(
        "all three turns and their last steps counted",
        WAIT,
        || async {
            let (_, body) = scrape(&server).await;
            let s = parse(&body);
            let ended_steps = value(&s, "harness_steps_total", &[("outcome", "finalized")])
                + value(&s, "harness_steps_total", &[("outcome", "stale")]);
            (value(&s, "harness_turns_completed_total", &[]) == 3.0 && ended_steps >= 3.0)
                .then_some(body)
        },
    )
    .await;
    let (ct, _) = scrape(&server).await;
    assert_eq!(ct, "text/plain; version=0.0.4; charset=utf-8");
    let s = parse(&body);
    let v = |name: &str, labels: &[(&str, &str)]| value(&s, name, labels);
    assert_eq!(v("harness_build_info", &[]), 1.0);
    assert_eq!(v("harness_turns_started_total", &[("kind", "root")]), 3.0);
    assert_eq!(
        v("harness_turns_started_total", &[("kind", "subagent")]),
        0.0
    );
    let completed = "harness_turns_completed_total";
    assert_eq!(
        v(completed, &[("status", "completed"), ("reason", "none")]),
        1.0
    );
    assert_eq!(
        v(
            completed,
            &[("status", "failed"), ("reason", "provider_permanent")]
        ),
        1.0
    );
    assert_eq!(
        v(completed, &[("status", "cancelled"), ("reason", "stopped")]),
        1.0
    );
    assert_eq!(
        v(
            "harness_function_calls_total",
            &[("function", "fx::forecast"), ("outcome", "ok")]
        ),
        1.0
    );
    assert_eq!(v("harness_function_calls_total", &[]), 1.0);
    assert_eq!(
        v(
            "harness_generation_errors_total",
            &[
                ("provider", "scripted"),
                ("model", "demo"),
                ("kind", "permanent")
            ]
        ),
        1.0
    );
    // The completed turn's generations reported 42 + 61 and 7 + 9; the failed one was
    // estimated by the router (input only), and the stopped one recorded none.
    assert!(recorded.input > 42.0 + 61.0);
    assert_eq!(recorded.output, 7.0 + 9.0);
    assert_eq!(
        v(
            "harness_tokens_total",
            &[("type", "input"), ("model", "demo")]
        ),
        recorded.input
    );
    assert_eq!(
        v("harness_tokens_total", &[("type", "output")]),
        recorded.output
    );
    // Every histogram's count is the number of what it times.
    assert_eq!(
        v("harness_generation_duration_seconds_count", &[]),
        recorded.generations as f64
    );
    assert_eq!(
        v("harness_step_duration_seconds_count", &[]),
        v("harness_steps_total", &[])
    );
    // The call's step advanced; the completed and the failed turn ended in a step; the
    // stopped one was ended by `harness::stop`, its step then found it over (stale) or ended it.
    assert_eq!(v("harness_steps_total", &[("outcome", "advanced")]), 1.0);
    assert_eq!(
        v("harness_steps_total", &[("outcome", "finalized")])
            + v("harness_steps_total", &[("outcome", "stale")]),
        3.0
    );
    assert_eq!(v("harness_function_call_duration_seconds_count", &[]), 1.0);
    // One handoff: the completed turn's second step followed its first in this process.
    assert_eq!(v("harness_step_handoff_seconds_count", &[]), 1.0);
    // Every generation that streamed something: the completed turn's two.
    assert!(v("harness_generation_time_to_first_chunk_seconds_count", &[]) >= 2.0);
    assert!(
        v(
            "harness_http_requests_total",
            &[("route", "/v1/functions/{function_id}"), ("code", "200")]
        ) >= 4.0
    );
    // Closed label sets.
    let closed: HashMap<&str, &[&str]> = HashMap::from([
        ("status", &["completed", "cancelled", "failed"][..]),
        (
            "reason",
            &[
                "none",
                "max_turns",
                "stopped",
                "budget_exceeded",
                "context_overflow",
                "context_compaction_failed",
                "output_contract_invalid",
                "provider_auth",
                "provider_rate_limited",
                "provider_transient",
                "provider_permanent",
                "timeout",
                "internal",
                "other",
            ][..],
        ),
        (
            "outcome",
            &[
                "advanced",
                "finalized",
                "parked",
                "stale",
                "failed",
                "ok",
                "error",
                "held",
                "interrupted",
            ][..],
        ),
        (
            "kind",
            &[
                "root",
                "subagent",
                "auth_expired",
                "rate_limited",
                "context_overflow",
                "transient",
                "permanent",
            ][..],
        ),
        (
            "type",
            &["input", "output", "cache_read", "cache_write", "reasoning"][..],
        ),
    ]);
    let session_statuses: &[&str] = &["idle", "working", "done", "error"];
    let queues: &[&str] = &["harness-turn", "harness-session-deletion"];
    for (name, labels, _) in &s {
        for (k, val) in labels {
            let set = match (name.as_str(), k.as_str()) {
                ("harness_sessions", "status") => Some(&session_statuses),
                (_, "queue") => Some(&queues),
                _ => closed.get(k.as_str()),
            };
            if let Some(set) = set {
                assert!(
                    set.contains(&val.as_str()),
                    "{name}: {k}=\"{val}\" is outside its set"
                );
            }
        }
    }
    // No session id, turn id or user text anywhere.
    for needle in ["s_metrics", "t_0", USER_TEXT, "Trondheim", "sunny"] {
        assert!(!body.contains(needle), "'{needle}' in /metrics");
    }
    let id = regex_like_id(&body);
    assert!(id.is_none(), "an id in /metrics: {id:?}");
    // A second scrape is stable (the request counter counts the scrapes themselves).
    let (_, again) = scrape(&server).await;
    let strip = |b: &str| {
        b.lines()
            .filter(|l| !l.contains("harness_http_requests_total"))
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    assert_eq!(strip(&body), strip(&again));
}

/// `[st]_<32 hex>` anywhere.
fn regex_like_id(body: &str) -> Option<String> {
    let b = body.as_bytes();
    for i in 0..b.len().saturating_sub(34) {
        if (b[i] == b's' || b[i] == b't')
            && b[i + 1] == b'_'
            && b[i + 2..i + 34]
                .iter()
                .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(c))
        {
            return Some(body[i..i + 34].to_string());
        }
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_metrics_turns_the_route_off() {
    let server = Server::start(
        &script(vec![text_gen(None, "ok", 0, true)]),
        &["--no-metrics"],
    )
    .await;
    let resp = reqwest::get(format!("{}/metrics", server.url()))
        .await
        .unwrap();
    assert_eq!(resp.status(), 404);
}

/// Whether `tool` (from Debian's `prometheus` package) is on PATH. Without it the test says it
/// is skipped, unless `require_var=1` (CI), which makes its absence a failure.
fn installed(tool: &str, require_var: &str) -> bool {
    let have = Command::new(tool)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !have {
        if std::env::var(require_var).as_deref() == Ok("1") {
            panic!("{require_var}=1 but {tool} is not on PATH (apt-get install prometheus)");
        }
        println!("skipped: {tool} is not on PATH (Debian: apt-get install prometheus)");
    }
    have
}

/// `promtool check metrics` on a scrape: exit 0. A counter without `_total` makes the same
/// check fail, so it has teeth. Skipped (with the reason) without `promtool`, unless
/// `HARNESS_REQUIRE_PROMTOOL=1` (CI), which makes its absence a failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_promtool() {
    if !installed("promtool", "HARNESS_REQUIRE_PROMTOOL") {
        return;
    }
    let check = |text: &str| {
        let out = output_with_stdin(Command::new("promtool").args(["check", "metrics"]), text);
        (
            out.status.code(),
            format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        )
    };
    let fx = Fixtures::new(json!([{"id": "fx::forecast", "response": {"sky": "sunny"}}]));
    let extra = server_args(&fx);
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    let server = Server::start(&run_script(), &extra).await;
    run(&server).await;
    let (_, body) = scrape(&server).await;
    let (code, said) = check(&body);
    assert_eq!(
        code,
        Some(0),
        "promtool rejected the scrape: {said}\n{body}"
    );
    let bad = "# HELP harness_bad A counter without its suffix.\n# TYPE harness_bad counter\nharness_bad 1\n";
    let (code, said) = check(bad);
    assert_ne!(
        code,
        Some(0),
        "promtool accepted a counter without _total: {said}"
    );
}

/// A real Prometheus (Debian's `prometheus`) scrapes `harness serve` every second: the target is
/// up with no error and a query answers the run's counts. Skipped (with the reason) without
/// `prometheus` on PATH, unless `HARNESS_REQUIRE_PROMETHEUS=1` (CI).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_prometheus_scrape() {
    if !installed("prometheus", "HARNESS_REQUIRE_PROMETHEUS") {
        return;
    }
    let fx = Fixtures::new(json!([{"id": "fx::forecast", "response": {"sky": "sunny"}}]));
    let extra = server_args(&fx);
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    let server = Server::start(&run_script(), &extra).await;
    run(&server).await;
    let target = server.url().trim_start_matches("http://").to_string();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: harness\n    scrape_interval: 1s\n    static_configs:\n      - targets: ['{target}']\n"
        ),
    )
    .unwrap();
    let port = free_port();
    let _prometheus = KillOnDrop(
        Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start prometheus"),
    );
    let base = format!("http://127.0.0.1:{port}");
    let client = reqwest::Client::new();
    wait_for("prometheus ready", WAIT, || async {
        let r = client.get(format!("{base}/-/ready")).send().await.ok()?;
        (r.status() == 200).then_some(())
    })
    .await;
    let completed = wait_for("the scraped completed count", WAIT, || async {
        let v = json_answer(client.get(format!("{base}/api/v1/query")).query(&[(
            "query",
            "harness_turns_completed_total{status=\"completed\",reason=\"none\"}",
        )]))
        .await?;
        v["data"]["result"][0]["value"][1]
            .as_str()
            .map(str::to_string)
    })
    .await;
    assert_eq!(completed, "1");
    let targets = json_answer(client.get(format!("{base}/api/v1/targets")))
        .await
        .expect("prometheus lists its targets");
    let t = &targets["data"]["activeTargets"][0];
    assert_eq!(t["health"], "up", "{t}");
    assert_eq!(t["lastError"], "", "{t}");
}

/// The gauges: a held approval, an open event stream, sessions by status (refreshed in the
/// background every 10 s), and the turn queue drained.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gauges_show_pending_approvals_open_streams_and_sessions() {
    let fx = Fixtures::new(json!([{"id": "fx::forecast", "response": {"sky": "sunny"}}]));
    let mut extra = server_args(&fx);
    extra.extend(["--approve".to_string(), "fx::*".to_string()]);
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    let server = Server::start(&run_script(), &extra).await;
    server
        .ok(
            "harness::send",
            json!({"session_id": "s_gauge_held", "message": USER_TEXT, "model": "demo", "provider": "scripted",
                   "options": {"functions": {"allow": ["fx::*"], "expose": "native"}}}),
        )
        .await;
    server
        .send_and_wait(
            json!({"session_id": "s_gauge_bad", "message": "break it", "model": "demo", "provider": "scripted"}),
        )
        .await;
    let _stream = server.events("s_gauge_held", None).await;
    let body = wait_for("the gauges to catch up", WAIT, || async {
        let (_, body) = scrape(&server).await;
        let s = parse(&body);
        let ok = value(&s, "harness_approvals_pending", &[]) == 1.0
            && value(&s, "harness_sessions", &[("status", "error")]) == 1.0
            && value(&s, "harness_sessions", &[("status", "working")]) == 1.0
            && value(&s, "harness_event_streams_open", &[]) == 1.0;
        ok.then_some(body)
    })
    .await;
    let s = parse(&body);
    assert_eq!(
        value(&s, "harness_queue_depth", &[("queue", "harness-turn")]),
        0.0,
        "the held turn's step was acknowledged"
    );
    assert_eq!(
        value(
            &s,
            "harness_queue_depth",
            &[("queue", "harness-session-deletion")]
        ),
        0.0
    );
}
