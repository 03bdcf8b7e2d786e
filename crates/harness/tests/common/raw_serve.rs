//! A `harness serve` child driven without a runtime: raw HTTP/1.1 over a socket, for the tests
//! that look at exact bytes and headers (HTTP lock-down, input fuzzing). Killed on drop.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{Api, WAIT};

pub struct RawServe {
    pub child: Child,
    pub port: u16,
    pub dir: tempfile::TempDir,
}

impl RawServe {
    /// Spawns `cmd` (a `harness serve` listening on `port`, its files in `dir`) with its stderr
    /// in `dir/log`, and waits for it to announce the bind.
    pub fn spawn(mut cmd: Command, port: u16, dir: tempfile::TempDir) -> RawServe {
        let log = std::fs::File::create(dir.path().join("log")).unwrap();
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn()
            .unwrap();
        let mut s = RawServe { child, port, dir };
        let deadline = Instant::now() + WAIT;
        while !s.log().contains("harness serving on") {
            s.assert_alive();
            assert!(
                Instant::now() < deadline,
                "serve did not start: {}",
                s.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        s
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("log")).unwrap_or_default()
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// A client for the function calls around the raw requests (no token, no Host set by hand).
    pub fn api(&self) -> Api {
        Api {
            base: self.url(),
            client: reqwest::Client::new(),
        }
    }

    /// SIGKILL, then reap.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn assert_alive(&mut self) {
        if let Some(status) = self.child.try_wait().unwrap() {
            panic!("harness serve died ({status}); log:\n{}", self.log());
        }
    }

    /// One raw HTTP/1.1 request with exactly these headers (and a `Content-Length`); returns
    /// the status and the whole answer, head and body.
    pub fn raw(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: impl AsRef<[u8]>,
    ) -> (u16, String) {
        let body = body.as_ref();
        let mut conn = TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        conn.set_read_timeout(Some(WAIT)).unwrap();
        let mut head = format!("{method} {path} HTTP/1.1\r\nConnection: close\r\n");
        for (k, v) in headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
        conn.write_all(head.as_bytes()).unwrap();
        conn.write_all(body).unwrap();
        let mut answer = Vec::new();
        conn.read_to_end(&mut answer)
            .unwrap_or_else(|e| panic!("{method} {path}: no answer within {WAIT:?}: {e}"));
        let answer = String::from_utf8_lossy(&answer).into_owned();
        let status = answer
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("no status line in {answer:?}"));
        (status, answer)
    }
}

impl Drop for RawServe {
    fn drop(&mut self) {
        self.kill();
    }
}
