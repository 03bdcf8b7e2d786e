//! Which tables and indexes the commits' WAL pages belong to, for a profile of the write path
//! ([`Store::record_wal_pages`](crate::Store::record_wal_pages)).
//!
//! A commit's cost is the pages it appends to the WAL, and those are B-tree pages of some
//! table or index. While recording, the WAL hook reads the page number of each frame a commit
//! appended and counts it; the count is mapped to names only when asked, with one scan of
//! `dbstat`. A page freed and reused by another tree in between is counted under its owner at
//! that time; pages on the free list are `(free)`.
//!
//! The page numbers are read from the WAL index (`-shm`), where SQLite keeps them side by side
//! (its documented WAL-index format): one read a commit. Reading each frame's header in the WAL
//! instead took a read a frame, 2.4 % of the writer's time in the bench's busiest cell, which
//! records while it measures. Without a readable index the frame headers are read.

use std::collections::HashMap;
use std::ffi::OsString;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use rusqlite::Connection;

use crate::StoreError;

/// SQLite's WAL header, before the first frame.
const WAL_HEADER: u64 = 32;
/// Each frame's header, before its page.
const FRAME_HEADER: u64 = 24;
/// The WAL index is made of 32 KiB blocks, each a run of frames' page numbers (native-endian
/// `u32`) and then a hash table; the first block starts with the index's 136-byte header, so it
/// holds 4,062 page numbers and every later block 4,096.
const SHM_BLOCK: u64 = 32 * 1024;
const SHM_HEADER: u64 = 136;
const SHM_FIRST_PAGES: u64 = (SHM_BLOCK / 2 - SHM_HEADER) / 4;
const SHM_PAGES: u64 = SHM_BLOCK / 2 / 4;

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
    shm_path: PathBuf,
    page_size: u64,
    state: Mutex<Option<Recording>>,
}

struct Recording {
    wal: Option<File>,
    shm: Option<File>,
    pages: HashMap<u32, u64>,
    buf: Vec<u8>,
}

/// Where frame `frame` (1-based) has its page number in the WAL index, and the last frame whose
/// page number follows it in the same block.
fn shm_slot(frame: u64) -> (u64, u64) {
    if frame <= SHM_FIRST_PAGES {
        return (SHM_HEADER + (frame - 1) * 4, SHM_FIRST_PAGES);
    }
    let i = frame - SHM_FIRST_PAGES - 1;
    let block = 1 + i / SHM_PAGES;
    (
        block * SHM_BLOCK + (i % SHM_PAGES) * 4,
        SHM_FIRST_PAGES + block * SHM_PAGES,
    )
}

impl PageLog {
    /// The recording of the database at `db`, whose pages are `page_size` bytes.
    pub(crate) fn new(db: &Path, page_size: u64) -> PageLog {
        let beside = |suffix: &str| {
            let mut path = OsString::from(db.as_os_str());
            path.push(suffix);
            PathBuf::from(path)
        };
        PageLog {
            wal_path: beside("-wal"),
            shm_path: beside("-shm"),
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
            shm: None,
            pages: HashMap::new(),
            buf: Vec::new(),
        });
    }

    /// Counts frames `first..=last` (1-based) of the WAL, which a commit just appended.
    pub(crate) fn commit(&self, first: i32, last: i32) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let Some(rec) = state.as_mut() else {
            return;
        };
        let (first, last) = (first.max(1) as u64, last.max(0) as u64);
        if first > last {
            return;
        }
        if rec.shm.is_none() {
            rec.shm = File::open(&self.shm_path).ok();
        }
        if let Some(shm) = &rec.shm {
            if read_index(shm, &mut rec.buf, first, last) {
                for b in rec.buf.chunks_exact(4) {
                    let page = u32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
                    *rec.pages.entry(page).or_default() += 1;
                }
                return;
            }
        }
        for page in self.frame_pages(rec, first, last) {
            *rec.pages.entry(page).or_default() += 1;
        }
    }

    /// The page numbers of frames `first..=last` from their frame headers in the WAL.
    fn frame_pages(&self, rec: &mut Recording, first: u64, last: u64) -> Vec<u32> {
        if rec.wal.is_none() {
            rec.wal = File::open(&self.wal_path).ok();
        }
        let Some(wal) = &rec.wal else {
            return Vec::new();
        };
        let mut header = [0u8; 4];
        (first..=last)
            .filter_map(|frame| {
                let at = WAL_HEADER + (frame - 1) * self.frame_bytes();
                wal.read_exact_at(&mut header, at)
                    .ok()
                    .map(|_| u32::from_be_bytes(header))
            })
            .collect()
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

/// Reads the page numbers of frames `first..=last` from the WAL index into `buf` (native-endian
/// `u32`s), one read a block of it. False when the index cannot be read or holds a zero, which
/// no frame has.
fn read_index(shm: &File, buf: &mut Vec<u8>, first: u64, last: u64) -> bool {
    buf.clear();
    let mut frame = first;
    while frame <= last {
        let (at, block_end) = shm_slot(frame);
        let upto = last.min(block_end);
        let from = buf.len();
        buf.resize(from + ((upto - frame + 1) * 4) as usize, 0);
        if shm.read_exact_at(&mut buf[from..], at).is_err() {
            return false;
        }
        frame = upto + 1;
    }
    !buf.chunks_exact(4).any(|b| b == [0, 0, 0, 0])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_has_its_page_number_where_the_wal_index_format_puts_it() {
        assert_eq!(SHM_FIRST_PAGES, 4062);
        assert_eq!(shm_slot(1), (136, 4062));
        assert_eq!(shm_slot(4062), (136 + 4061 * 4, 4062));
        // The second block starts with the page numbers, no header.
        assert_eq!(shm_slot(4063), (32768, 4062 + 4096));
        assert_eq!(shm_slot(4062 + 4096), (32768 + 4095 * 4, 4062 + 4096));
        assert_eq!(shm_slot(4062 + 4097), (2 * 32768, 4062 + 2 * 4096));
    }

    /// Across the WAL index's first blocks, the page numbers read from it are the ones in the
    /// frames' own headers.
    #[test]
    fn the_wal_index_names_the_pages_the_frame_headers_name() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("w.db");
        let conn = Connection::open(&db).unwrap();
        conn.pragma_update(None, "journal_mode", "WAL").unwrap();
        conn.pragma_update(None, "wal_autocheckpoint", 0).unwrap();
        conn.execute_batch("CREATE TABLE t(k INTEGER PRIMARY KEY, v TEXT)")
            .unwrap();
        // ~9,000 frames: past the end of the index's second block.
        for chunk in 0..90 {
            let tx = conn.unchecked_transaction().unwrap();
            for i in 0..100 {
                tx.execute(
                    "INSERT INTO t VALUES (?1, ?2)",
                    rusqlite::params![chunk * 100 + i, "v".repeat(3000)],
                )
                .unwrap();
            }
            tx.commit().unwrap();
        }
        let log = PageLog::new(&db, 4096);
        let frames = (std::fs::metadata(dir.path().join("w.db-wal"))
            .unwrap()
            .len()
            - WAL_HEADER)
            / log.frame_bytes();
        assert!(frames > SHM_FIRST_PAGES + SHM_PAGES, "{frames} frames");
        let shm = File::open(&log.shm_path).unwrap();
        let mut rec = Recording {
            wal: None,
            shm: None,
            pages: HashMap::new(),
            buf: Vec::new(),
        };
        let from_headers = log.frame_pages(&mut rec, 1, frames);
        let mut buf = Vec::new();
        assert!(read_index(&shm, &mut buf, 1, frames));
        let from_index: Vec<u32> = buf
            .chunks_exact(4)
            .map(|b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        assert_eq!(from_index.len(), from_headers.len());
        assert_eq!(from_index, from_headers);
        // A range that starts in one block and ends in the next.
        assert!(read_index(&shm, &mut buf, 4000, 4200));
        assert_eq!(buf.len(), 201 * 4);
        drop(conn);
    }
}
