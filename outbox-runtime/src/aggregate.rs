//! Aggregates: what `#[aggregate]` implements, and the buffer of events they record.
//!
//! An aggregate records events as its state changes ([`Aggregate::record`]); a unit of work
//! takes them into the outbox in the same transaction as the aggregate's own rows. The events
//! leave the buffer only once that transaction has committed: a rollback, or a commit that
//! fails, leaves them pending for the next attempt.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::event::DomainEvent;

/// An aggregate: a consistency boundary whose changes are published as events.
///
/// Implemented by `#[aggregate]`, which also adds the [`PendingEvents`] field and the
/// inherent methods `record` and `pending_events` (so callers need not import this trait).
pub trait Aggregate {
    /// The event type this aggregate records.
    type Event: DomainEvent;

    /// The aggregate type name: the second token of its events' subjects and their
    /// `ce-aggregatetype`. A valid NATS subject token.
    const AGGREGATE_TYPE: &'static str;

    /// This aggregate's id, as written to `aggregate_id` and `ce-subject`. It must be a valid
    /// NATS subject token (it is the default partition key); the unit of work checks it.
    fn aggregate_id(&self) -> String;

    /// The buffer of events recorded and not yet committed.
    fn pending(&self) -> &PendingEvents<Self::Event>;

    /// The buffer, mutably.
    fn pending_mut(&mut self) -> &mut PendingEvents<Self::Event>;

    /// Records `event`: it is written to the outbox by the next unit of work that tracks this
    /// aggregate and commits.
    fn record(&mut self, event: Self::Event) {
        self.pending_mut().push(event);
    }

    /// The events recorded and not yet committed, oldest first.
    fn pending_events(&self) -> &[Self::Event] {
        self.pending().as_slice()
    }
}

/// The events an aggregate has recorded and no committed unit of work has taken yet.
///
/// `#[aggregate]` adds one as the field `pending_events`; a struct literal sets it with
/// `pending_events: PendingEvents::new()` (or `Default::default()`).
///
/// Cloning copies the pending events into an independent buffer: a commit that takes the
/// original's events leaves the clone's in place.
pub struct PendingEvents<E> {
    events: Vec<E>,
    /// How many events at the front of `events` a committed unit of work has taken. The
    /// unit of work holds a clone of this counter and advances it after COMMIT, when it no
    /// longer borrows the aggregate; the buffer drops those events on its next mutation.
    committed: Arc<AtomicUsize>,
}

impl<E> PendingEvents<E> {
    /// An empty buffer.
    pub fn new() -> Self {
        Self {
            events: Vec::new(),
            committed: Arc::new(AtomicUsize::new(0)),
        }
    }

    fn committed(&self) -> usize {
        self.committed
            .load(Ordering::Acquire)
            .min(self.events.len())
    }

    /// The pending events, oldest first.
    pub fn as_slice(&self) -> &[E] {
        &self.events[self.committed()..]
    }

    /// The number of pending events.
    pub fn len(&self) -> usize {
        self.as_slice().len()
    }

    /// Whether no event is pending.
    pub fn is_empty(&self) -> bool {
        self.as_slice().is_empty()
    }

    /// Iterates over the pending events, oldest first.
    pub fn iter(&self) -> std::slice::Iter<'_, E> {
        self.as_slice().iter()
    }

    /// Appends an event (what [`Aggregate::record`] calls).
    pub fn push(&mut self, event: E) {
        self.drop_committed();
        self.events.push(event);
    }

    fn drop_committed(&mut self) {
        let committed = self
            .committed
            .swap(0, Ordering::AcqRel)
            .min(self.events.len());
        self.events.drain(..committed);
    }

    /// What a unit of work holds to drain the events it takes: the shared counter.
    pub(crate) fn commit_handle(&self) -> CommitHandle {
        CommitHandle(Arc::clone(&self.committed))
    }
}

/// Lets a unit of work mark, after COMMIT, how many of an aggregate's pending events it wrote.
#[derive(Clone)]
pub(crate) struct CommitHandle(Arc<AtomicUsize>);

impl CommitHandle {
    /// Whether both handles belong to the same buffer (the same aggregate value).
    pub(crate) fn same_buffer(&self, other: &CommitHandle) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// Drops the first `count` pending events from the buffer.
    pub(crate) fn mark_committed(&self, count: usize) {
        self.0.fetch_add(count, Ordering::AcqRel);
    }
}

impl<E> Default for PendingEvents<E> {
    fn default() -> Self {
        Self::new()
    }
}

impl<E: Clone> Clone for PendingEvents<E> {
    fn clone(&self) -> Self {
        Self {
            events: self.as_slice().to_vec(),
            committed: Arc::new(AtomicUsize::new(0)),
        }
    }
}

impl<E: fmt::Debug> fmt::Debug for PendingEvents<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.as_slice()).finish()
    }
}

impl<E: PartialEq> PartialEq for PendingEvents<E> {
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl<E: Eq> Eq for PendingEvents<E> {}

impl<'a, E> IntoIterator for &'a PendingEvents<E> {
    type Item = &'a E;
    type IntoIter = std::slice::Iter<'a, E>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn committed_events_leave_the_view_at_once_and_the_vec_on_next_push() {
        let mut pending = PendingEvents::new();
        pending.push(1);
        pending.push(2);
        let handle = pending.commit_handle();
        handle.mark_committed(1);
        assert_eq!(pending.as_slice(), &[2]);
        pending.push(3);
        assert_eq!(pending.as_slice(), &[2, 3]);
        assert_eq!(pending.events, vec![2, 3], "the committed event is dropped");
        handle.mark_committed(2);
        assert!(pending.is_empty());
    }

    #[test]
    fn a_clone_is_independent_of_the_original_commit() {
        let mut pending = PendingEvents::new();
        pending.push("a");
        let clone = pending.clone();
        pending.commit_handle().mark_committed(1);
        assert!(pending.is_empty());
        assert_eq!(clone.as_slice(), &["a"]);
        assert!(!clone.commit_handle().same_buffer(&pending.commit_handle()));
    }
}
