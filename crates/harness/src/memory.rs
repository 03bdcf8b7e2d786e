//! Giving free memory back to the OS: the allocator is chosen here (main.rs), so the binary is
//! what can tell it to let go of what it keeps.

/// mimalloc (the global allocator): frees the calling thread's unused pages and purges every
/// free page of the process's arenas now, rather than after its delay.
pub(crate) fn collect_free_memory() {
    extern "C" {
        fn mi_collect(force: bool);
    }
    // SAFETY: takes no pointer; mimalloc is linked in as the global allocator.
    unsafe { mi_collect(true) }
}

/// An idle store's writer runs [`collect_free_memory`] on its own thread once it has settled
/// after a burst: mimalloc keeps a thread's free pages for that thread until it is told.
pub(crate) fn release_when_idle() {
    harness_store::set_idle_release(collect_free_memory);
}
