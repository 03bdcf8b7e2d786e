//! The OTLP exporter against a loopback collector, with no Tokio runtime anywhere in the test:
//! the batch processor posts from its own thread, as it does in the binary, through the
//! workspace's blocking reqwest client.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::mpsc;
use std::time::Duration;

use harness_core::trace::SpanSink;
use harness_core::trace::{AttrValue, SpanKind, SpanRecord};
use harness_telemetry::otlp::Sampler;
use harness_telemetry::{EndpointSource, OtlpConfig, OtlpSink};

/// One request as the collector saw it.
struct Seen {
    request_line: String,
    content_type: Option<String>,
    body: Vec<u8>,
}

/// A collector on loopback that answers every request with `status`; what it received comes
/// out of the channel.
fn collector(status: u16) -> (String, mpsc::Receiver<Seen>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/v1/traces", listener.local_addr().unwrap());
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut request_line = String::new();
            if reader.read_line(&mut request_line).unwrap_or(0) == 0 {
                continue;
            }
            let mut content_type = None;
            let mut length = 0usize;
            loop {
                let mut line = String::new();
                reader.read_line(&mut line).unwrap();
                let line = line.trim_end();
                if line.is_empty() {
                    break;
                }
                let (name, value) = line.split_once(':').unwrap();
                match name.to_ascii_lowercase().as_str() {
                    "content-type" => content_type = Some(value.trim().to_string()),
                    "content-length" => length = value.trim().parse().unwrap(),
                    _ => {}
                }
            }
            let mut body = vec![0; length];
            reader.read_exact(&mut body).unwrap();
            let _ = tx.send(Seen {
                request_line: request_line.trim_end().to_string(),
                content_type,
                body,
            });
            let _ = write!(
                stream,
                "HTTP/1.1 {status} X\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
            );
        }
    });
    (url, rx)
}

fn sink(endpoint: String) -> OtlpSink {
    OtlpSink::start(&OtlpConfig {
        endpoint,
        source: EndpointSource::Flag,
        sampler: Sampler::On,
    })
    .unwrap()
}

fn span(name: &str) -> SpanRecord {
    SpanRecord {
        trace_id: "4bf92f3577b34da6a3ce929d0e0e4736".into(),
        span_id: "00f067aa0ba902b7".into(),
        parent_span_id: None,
        parent_remote: false,
        sampled: true,
        name: name.into(),
        kind: SpanKind::Client,
        start_us: 1_000_000,
        end_us: 1_250_000,
        attributes: vec![("gen_ai.request.model", AttrValue::Str("demo".into()))],
        error: None,
        links: vec![],
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

#[test]
fn a_span_is_posted_as_protobuf_from_the_processors_own_thread() {
    assert!(tokio::runtime::Handle::try_current().is_err());
    let (url, seen) = collector(200);
    let sink = sink(url);
    sink.export(vec![span("chat exported-span")]);
    sink.shutdown();
    let got = seen.recv_timeout(Duration::from_secs(10)).expect("a POST");
    assert_eq!(got.request_line, "POST /v1/traces HTTP/1.1");
    assert_eq!(got.content_type.as_deref(), Some("application/x-protobuf"));
    // Protobuf keeps strings and byte ids as they are: the span's name and its trace id.
    assert!(contains(&got.body, b"chat exported-span"));
    let trace_id: Vec<u8> = (0..16)
        .map(|i| {
            u8::from_str_radix(&"4bf92f3577b34da6a3ce929d0e0e4736"[2 * i..2 * i + 2], 16).unwrap()
        })
        .collect();
    assert!(contains(&got.body, &trace_id));
    assert_eq!(sink.dropped(), 0);
}

#[test]
fn a_collector_that_answers_an_error_status_has_the_batch_counted_lost() {
    let (url, seen) = collector(503);
    let sink = sink(url);
    sink.export(vec![span("chat refused"), span("chat refused too")]);
    sink.shutdown();
    let got = seen.recv_timeout(Duration::from_secs(10)).expect("a POST");
    assert!(contains(&got.body, b"chat refused"));
    assert_eq!(sink.dropped(), 2);
}

#[test]
fn a_collector_nobody_listens_on_has_the_batch_counted_lost() {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let sink = sink(format!("http://127.0.0.1:{port}/v1/traces"));
    sink.export(vec![span("chat nowhere")]);
    sink.shutdown();
    assert_eq!(sink.dropped(), 1);
}
