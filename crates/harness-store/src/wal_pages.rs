//! Which tables and indexes the commits' WAL pages belong to, for a profile of the write path
//! ([`Store::record_wal_pages`](crate::Store::record_wal_pages)).
//!
//! A commit's cost is the pages it appends to the WAL, and those are B-tree pages of some
//! table or index. While recording, the WAL hook reads the page number of each frame a commit
//! appended (24-byte frame headers, from the page cache) and counts it; the count is mapped to
//! names only when asked, with one scan of `dbstat`. A page freed and reused by another tree in
//! between is counted under its owner at that time; pages on the free list are `(free)`.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Mutex;

use rusqlite::Connection;

use crate::StoreError;

/// SQLite's WAL header, before the first frame.
const WAL_HEADER: u64 = 32;
/// Each frame's header, before its page.
const FRAME_HEADER: u64 = 24;

/// WAL pages by the table or index they belong to, from [`crate::Store::wal_pages_by_table`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WalPages {
    /// Bytes one page costs in the WAL (the page and its frame header).
    pub frame_bytes: u64,
    /// `(table or index, pages)`, most pages first.
    pub by_table: Vec<(String, u64)>,
}

impl WalPages {
    pub fn pages(&self) -> u64 {
        self.by_table.iter().map(|(_, n)| n).sum()
    }
}

/// The recording the WAL hook adds to.
pub(crate) struct PageLog {
    wal_path: PathBuf,
    page_size: u64,
    state: Mutex<Option<Recording>>,
}

struct Recording {
    wal: Option<File>,
    pages: HashMap<u32, u64>,
}

impl PageLog {
    pub(crate) fn new(wal_path: PathBuf, page_size: u64) -> PageLog {
        PageLog {
            wal_path,
            page_size,
            state: Mutex::new(None),
        }
    }

    pub(crate) fn frame_bytes(&self) -> u64 {
        self.page_size + FRAME_HEADER
    }

    /// Starts a fresh recording, or stops recording.
    pub(crate) fn set(&self, on: bool) {
        *self.state.lock().unwrap_or_else(|e| e.into_inner()) = on.then(|| Recording {
            wal: None,
            pages: HashMap::new(),
        });
    }

    /// Counts frames `first..=last` (1-based) of the WAL, which a commit just appended.
    pub(crate) fn commit(&self, first: i32, last: i32) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let Some(rec) = state.as_mut() else {
            return;
        };
        if rec.wal.is_none() {
            rec.wal = File::open(&self.wal_path).ok();
        }
        let Some(wal) = &rec.wal else {
            return;
        };
        let mut header = [0u8; 4];
        for frame in first.max(1)..=last {
            let at = WAL_HEADER + (frame as u64 - 1) * self.frame_bytes();
            if wal.read_exact_at(&mut header, at).is_ok() {
                *rec.pages.entry(u32::from_be_bytes(header)).or_default() += 1;
            }
        }
    }

    /// What was recorded since [`PageLog::set`], by owner (recording goes on).
    pub(crate) fn by_table(&self, conn: &Connection) -> Result<WalPages, StoreError> {
        let pages = {
            let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
            state.as_ref().map(|r| r.pages.clone()).unwrap_or_default()
        };
        let mut owner: HashMap<u32, String> = HashMap::with_capacity(pages.len());
        let mut stmt = conn.prepare("SELECT name, pageno FROM dbstat")?;
        let mut rows = stmt.query([])?;
        while let Some(row) = rows.next()? {
            let page: u32 = row.get(1)?;
            if pages.contains_key(&page) {
                owner.insert(page, row.get(0)?);
            }
        }
        let mut totals: HashMap<String, u64> = HashMap::new();
        for (page, n) in pages {
            let name = owner.remove(&page).unwrap_or_else(|| "(free)".to_string());
            *totals.entry(name).or_default() += n;
        }
        let mut by_table: Vec<(String, u64)> = totals.into_iter().collect();
        by_table.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        Ok(WalPages {
            frame_bytes: self.frame_bytes(),
            by_table,
        })
    }
}
