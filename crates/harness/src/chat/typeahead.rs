//! Type-ahead while a reply streams. A terminal echoes what is typed the moment it is typed, so
//! a line typed during a reply landed in the middle of the reply's text. While a reply streams
//! the terminal neither echoes nor edits lines ([`hold`]); what was typed is read back when the
//! reply ends ([`release`]) and shown after the next prompt as the start of the next message.
//! Ctrl-C still signals (ISIG stays on). Not a terminal: nothing to hold.

use std::sync::Mutex;

/// The terminal settings to put back, while held.
static SAVED: Mutex<Option<libc::termios>> = Mutex::new(None);
/// Bytes typed during replies and not yet handed to a prompt.
static TYPED: Mutex<Vec<u8>> = Mutex::new(Vec::new());

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Stops echo and line editing on a terminal stdin until [`release`].
pub(crate) fn hold() {
    let mut saved = lock(&SAVED);
    if saved.is_some() || !std::io::IsTerminal::is_terminal(&std::io::stdin()) {
        return;
    }
    // SAFETY: termios is plain data, filled by tcgetattr before it is read.
    let mut t: libc::termios = unsafe { std::mem::zeroed() };
    if unsafe { libc::tcgetattr(libc::STDIN_FILENO, &mut t) } != 0 {
        return;
    }
    let original = t;
    t.c_lflag &= !(libc::ECHO | libc::ICANON);
    t.c_cc[libc::VMIN] = 1;
    t.c_cc[libc::VTIME] = 0;
    if unsafe { libc::tcsetattr(libc::STDIN_FILENO, libc::TCSANOW, &t) } == 0 {
        *saved = Some(original);
    }
}

/// Reads what was typed while held, then gives the terminal its settings back. True when it
/// was held.
pub(crate) fn release() -> bool {
    let mut saved = lock(&SAVED);
    let Some(original) = saved.take() else {
        return false;
    };
    let mut pending: libc::c_int = 0;
    // SAFETY: FIONREAD writes one int; the read is bounded by the buffer's length.
    if unsafe { libc::ioctl(libc::STDIN_FILENO, libc::FIONREAD, &mut pending) } == 0 && pending > 0
    {
        let mut buf = vec![0u8; pending as usize];
        let n = unsafe {
            libc::read(
                libc::STDIN_FILENO,
                buf.as_mut_ptr().cast(),
                buf.len() as libc::size_t,
            )
        };
        if n > 0 {
            lock(&TYPED).extend_from_slice(&buf[..n as usize]);
        }
    }
    unsafe { libc::tcsetattr(libc::STDIN_FILENO, libc::TCSANOW, &original) };
    true
}

/// [`hold`] until dropped, so an error on the way out gives the terminal back too.
pub(crate) struct Held;

impl Held {
    pub(crate) fn new() -> Held {
        hold();
        Held
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        release();
    }
}

/// Gives the terminal back for a question asked mid-reply (an approval) and holds it again
/// when dropped.
pub(crate) struct Opened(bool);

impl Opened {
    pub(crate) fn new() -> Opened {
        Opened(release())
    }
}

impl Drop for Opened {
    fn drop(&mut self) {
        if self.0 {
            hold();
        }
    }
}

/// What was typed ahead, as the terminal would have edited it: the first finished line (the
/// next message, `true`) or the unfinished rest (`false`, the start of the next line). Later
/// lines stay for the prompts after it.
pub(crate) fn take() -> Option<(String, bool)> {
    let mut typed = lock(&TYPED);
    if typed.is_empty() {
        return None;
    }
    let end = typed.iter().position(|&b| b == b'\n' || b == b'\r');
    let line: Vec<u8> = match end {
        Some(at) => {
            let line = typed[..at].to_vec();
            typed.drain(..=at);
            line
        }
        None => std::mem::take(&mut *typed),
    };
    Some((edited(&line), end.is_some()))
}

/// Applies the line-editing keys a terminal would have: erase (DEL, BS), kill line (Ctrl-U),
/// erase word (Ctrl-W); other control bytes are dropped.
fn edited(raw: &[u8]) -> String {
    let mut out: Vec<char> = Vec::new();
    for c in String::from_utf8_lossy(raw).chars() {
        match c {
            '\u{7f}' | '\u{8}' => {
                out.pop();
            }
            '\u{15}' => out.clear(),
            '\u{17}' => {
                while out.last().is_some_and(|c| c.is_whitespace()) {
                    out.pop();
                }
                while out.last().is_some_and(|c| !c.is_whitespace()) {
                    out.pop();
                }
            }
            c if c.is_control() && c != '\t' => {}
            c => out.push(c),
        }
    }
    out.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn editing_keys_are_applied_and_lines_come_one_at_a_time() {
        assert_eq!(edited(b"helo\x7flo"), "hello");
        assert_eq!(edited(b"junk\x15fine"), "fine");
        assert_eq!(edited(b"one two\x17three"), "one three");
        lock(&TYPED).extend_from_slice(b"first\rsecond\npart");
        assert_eq!(take(), Some(("first".into(), true)));
        assert_eq!(take(), Some(("second".into(), true)));
        assert_eq!(take(), Some(("part".into(), false)));
        assert_eq!(take(), None);
    }
}
