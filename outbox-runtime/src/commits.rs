//! The units of work of this process that committed events, for the relays of databases
//! without notifications (MySQL, SQLite): a relay in the same process is woken at each commit
//! instead of waiting for its next poll.

use std::sync::atomic::{AtomicU64, Ordering};

use tokio::sync::Notify;

/// Counts the units of work of this process that committed events, and wakes the
/// polling relay workers of this process that wait for rows.
pub(crate) struct Commits {
    count: AtomicU64,
    notify: Notify,
}

impl Commits {
    /// How many units of work with events committed in this process so far.
    pub(crate) fn count(&self) -> u64 {
        AtomicU64::load(&self.count, Ordering::Acquire)
    }

    /// Resolves at the next commit after this call (the caller reads [`count`](Self::count)
    /// after enabling it, so no commit is missed between the two).
    pub(crate) fn notified(&self) -> tokio::sync::futures::Notified<'_> {
        self.notify.notified()
    }

    /// Called by a unit of work after its COMMIT.
    pub(crate) fn committed(&self) {
        self.count.fetch_add(1, Ordering::AcqRel);
        self.notify.notify_waiters();
    }
}

/// The process's [`Commits`].
pub(crate) static COMMITS: Commits = Commits {
    count: AtomicU64::new(0),
    notify: Notify::const_new(),
};
