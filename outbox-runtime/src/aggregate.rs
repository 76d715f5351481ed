//! Aggregates: what `#[aggregate]` implements, and the buffer of events they record.
//!
//! An aggregate records events as its state changes ([`Aggregate::record`]); a unit of work
//! takes them into the outbox in the same transaction as the aggregate's own rows. The events
//! leave the buffer only once that transaction has committed: a rollback, or a commit that
//! fails, leaves them pending for the next attempt.

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

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

    /// Drops the events recorded and not yet committed, on purpose, and returns them
    /// ([`PendingEvents::discard`]): dropping an aggregate that still holds events logs a
    /// warning in debug builds, as they are lost.
    fn discard_pending_events(&mut self) -> Vec<Self::Event> {
        self.pending_mut().discard()
    }
}

/// The events an aggregate has recorded and no committed unit of work has taken yet.
///
/// An `#[aggregate]` struct declares one as a field (`pending_events:
/// PendingEvents<OrderEvent>`); a struct literal sets it with `PendingEvents::new()` (or
/// `Default::default()`).
///
/// Once a unit of work has tracked the aggregate, events recorded on it before that unit of
/// work ends are part of it too: [`UnitOfWork::track`](crate::UnitOfWork::track) takes what
/// is pending and everything recorded after, until COMMIT.
///
/// Dropping a buffer that still holds events loses them: in debug builds the drop logs a
/// warning (`tracing`, target `outbox_runtime::aggregate`) naming the event type and the
/// count. [`discard`](Self::discard) drops them on purpose, without the warning.
///
/// Cloning copies the pending events into an independent buffer: a commit that takes the
/// original's events leaves the clone's in place.
pub struct PendingEvents<E> {
    events: Vec<E>,
    /// What the unit of work that tracks this buffer shares with it.
    shared: Arc<Shared<E>>,
}

/// The part of a buffer a unit of work holds while it tracks it.
struct Shared<E> {
    /// How many events at the front of `events` a committed unit of work has taken. The unit
    /// of work advances it after COMMIT, when it no longer borrows the aggregate; the buffer
    /// drops those events on its next mutation.
    committed: AtomicUsize,
    /// Where events recorded while a unit of work tracks the buffer also go, until it ends.
    late: Mutex<Option<Arc<dyn LateEvents<E>>>>,
}

/// A unit of work's receiver of the events recorded on an aggregate after it was tracked.
pub(crate) trait LateEvents<E>: Send + Sync {
    /// Called by [`PendingEvents::push`] with each event recorded while attached.
    fn recorded(&self, event: &E);
}

impl<E> PendingEvents<E> {
    /// An empty buffer.
    pub fn new() -> Self {
        Self {
            events: Vec::new(),
            shared: Arc::new(Shared {
                committed: AtomicUsize::new(0),
                late: Mutex::new(None),
            }),
        }
    }

    fn committed(&self) -> usize {
        self.shared
            .committed
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

    /// Appends an event (what [`Aggregate::record`] calls); a unit of work that tracks this
    /// buffer takes it too.
    pub fn push(&mut self, event: E) {
        self.drop_committed();
        if let Some(late) = lock(&self.shared.late).as_ref() {
            late.recorded(&event);
        }
        self.events.push(event);
    }

    /// Drops the pending events on purpose and returns them: they will not be written by any
    /// unit of work, and dropping the buffer afterwards logs no warning. Events a unit of
    /// work has already taken stay in that unit of work.
    pub fn discard(&mut self) -> Vec<E> {
        self.drop_committed();
        std::mem::take(&mut self.events)
    }

    fn drop_committed(&mut self) {
        let committed = self
            .shared
            .committed
            .swap(0, Ordering::AcqRel)
            .min(self.events.len());
        self.events.drain(..committed);
    }

    /// What a unit of work holds to drain the events it takes after COMMIT.
    pub(crate) fn commit_handle(&self) -> CommitHandle
    where
        E: 'static,
    {
        CommitHandle(Arc::clone(&self.shared) as Arc<dyn BufferControl>)
    }

    /// Sends the events recorded from now on to `late` too, until the handle's
    /// [`CommitHandle::detach`]. Returns false, attaching nothing, when another unit of work
    /// tracks this buffer already.
    pub(crate) fn attach(&self, late: Arc<dyn LateEvents<E>>) -> bool {
        let mut slot = lock(&self.shared.late);
        if slot.is_some() {
            return false;
        }
        *slot = Some(late);
        true
    }
}

/// Locks `mutex`, whose data a panic cannot leave inconsistent (an `Option` set or taken).
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// What a unit of work does to a tracked buffer, whatever its event type.
trait BufferControl: Send + Sync {
    fn mark_committed(&self, count: usize);
    fn detach(&self);
}

impl<E> BufferControl for Shared<E> {
    fn mark_committed(&self, count: usize) {
        self.committed.fetch_add(count, Ordering::AcqRel);
    }

    fn detach(&self) {
        lock(&self.late).take();
    }
}

/// Lets a unit of work mark, after COMMIT, how many of an aggregate's pending events it wrote.
#[derive(Clone)]
pub(crate) struct CommitHandle(Arc<dyn BufferControl>);

impl CommitHandle {
    /// The buffer's address: equal for two handles of the same buffer (the same aggregate
    /// value), and never another buffer's while this handle keeps it alive.
    pub(crate) fn buffer_address(&self) -> usize {
        Arc::as_ptr(&self.0).cast::<()>() as usize
    }

    /// Drops the first `count` pending events from the buffer.
    pub(crate) fn mark_committed(&self, count: usize) {
        self.0.mark_committed(count);
    }

    /// Stops sending recorded events to the unit of work that attached to the buffer.
    pub(crate) fn detach(&self) {
        self.0.detach();
    }
}

impl<E> Drop for PendingEvents<E> {
    fn drop(&mut self) {
        if cfg!(debug_assertions) && !self.is_empty() && !std::thread::panicking() {
            tracing::warn!(
                events = self.len(),
                event_type = std::any::type_name::<E>(),
                "an aggregate was dropped with events that no unit of work committed: they are \
                 lost (track it in a unit of work that commits, or `discard` them on purpose)"
            );
        }
    }
}

impl<E> Default for PendingEvents<E> {
    fn default() -> Self {
        Self::new()
    }
}

impl<E: Clone> Clone for PendingEvents<E> {
    fn clone(&self) -> Self {
        let mut clone = Self::new();
        clone.events = self.as_slice().to_vec();
        clone
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
        assert_ne!(
            clone.commit_handle().buffer_address(),
            pending.commit_handle().buffer_address()
        );
        assert_eq!(
            pending.commit_handle().buffer_address(),
            pending.commit_handle().buffer_address()
        );
    }
}
