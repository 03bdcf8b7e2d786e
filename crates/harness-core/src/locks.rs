//! Per-session locks.
//!
//! Every writer of a turn record (step, send, stop) holds its session's lock, so a read-modify-
//! write of the record is atomic within this process. The map holds weak references, so a
//! session that nobody is working on costs nothing; the std Mutex around the map is held only to
//! look up or insert an entry, never across an await. The per-session lock itself is a tokio
//! Mutex because a step holds it across store calls.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use tokio::sync::{Mutex as AsyncMutex, OwnedMutexGuard};

#[derive(Default)]
pub(crate) struct SessionLocks {
    map: Mutex<HashMap<String, Weak<AsyncMutex<()>>>>,
}

pub(crate) type SessionGuard = OwnedMutexGuard<()>;

impl SessionLocks {
    pub(crate) async fn lock(&self, session_id: &str) -> SessionGuard {
        let lock = {
            let mut map = self.map.lock().expect("session lock map");
            match map.get(session_id).and_then(Weak::upgrade) {
                Some(lock) => lock,
                None => {
                    let lock = Arc::new(AsyncMutex::new(()));
                    map.insert(session_id.to_string(), Arc::downgrade(&lock));
                    // Keep the map from growing with dead entries.
                    if map.len() > 1024 && map.len().is_power_of_two() {
                        map.retain(|_, w| w.strong_count() > 0);
                    }
                    lock
                }
            }
        };
        lock.lock_owned().await
    }

    /// How many hold or wait for a session's lock (the holder counts).
    #[cfg(test)]
    pub(crate) fn sharers(&self, session_id: &str) -> usize {
        let map = self.map.lock().expect("session lock map");
        map.get(session_id).map_or(0, Weak::strong_count)
    }

    #[cfg(test)]
    pub(crate) fn live(&self) -> usize {
        let map = self.map.lock().expect("session lock map");
        map.values().filter(|w| w.strong_count() > 0).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn same_session_serializes_and_idle_sessions_cost_nothing() {
        let locks = SessionLocks::default();
        let g = locks.lock("a").await;
        assert!(
            tokio::time::timeout(std::time::Duration::from_millis(20), locks.lock("a"))
                .await
                .is_err()
        );
        let _other = locks.lock("b").await;
        drop(g);
        let _again = locks.lock("a").await;
        drop(_again);
        drop(_other);
        assert_eq!(locks.live(), 0);
    }
}
