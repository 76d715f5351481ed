//! The doorbell: the relay asks inserting transactions to notify it only while it waits.
//!
//! A transaction that issues `NOTIFY` takes a database-wide lock at COMMIT and keeps it until
//! its commit record is flushed (PostgreSQL's `src/backend/commands/async.c`,
//! `PreCommit_Notify`): notifying commits flush one after another instead of together. With
//! 32 concurrent writers, a notification from every unit of work cost a third to a half of
//! their throughput (the benchmark's figure 11). Only a relay with nothing to do needs a
//! notification, so the
//! outbox's insert trigger notifies only while one waits, told by an advisory lock
//! ([`doorbell_lock`], keyed by the outbox table so that each schema's outbox has its own):
//!
//! - the relay *arms* the doorbell when all its workers found nothing to claim: its `LISTEN`
//!   connection takes the lock exclusively (`pg_advisory_lock`), then a worker claims once
//!   more before they sleep;
//! - each inserting transaction tries the lock in shared mode (`pg_try_advisory_xact_lock_shared`,
//!   kept until COMMIT) and notifies when the try fails: a relay holds the lock or waits for
//!   it;
//! - a transaction whose try succeeded did not notify, but the relay's exclusive lock waits
//!   for it to end (an advisory lock conflicts like any other: PostgreSQL docs, "Advisory
//!   Locks"), so the claim the relay makes once it holds the lock sees its rows;
//! - a relay under load *disarms* the doorbell (the lock is released, the trigger stops
//!   notifying): a worker claimed rows in two batches in a row ([`Doorbell::busy`]);
//!   workers claim again at once after each batch, and a batch that claimed rows wakes the
//!   others. It holds the *busy lock* ([`busy_lock`]) in shared mode meanwhile, and another
//!   relay arms the doorbell only while no relay holds that: the busy relay claims what
//!   commits, and takes the doorbell itself when it finds nothing;
//! - a relay whose workers all back off (broker away, failures) releases both, so another
//!   relay takes the doorbell.
//!
//! So every committed row is seen by a claim or followed by a notification, as when every
//! insert notified; under load, when the relay is always busy, no unit of work notifies.
//!
//! A worker knows the doorbell was armed for the whole of its claim by the *epoch*: a number
//! set when the lock is granted and cleared before it is released, read before the claim and
//! again after it.

use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::watch;

/// The first key of the relay's doorbell, an advisory lock of two `int4` keys: `'outb'` as a
/// big-endian `int4`. The second is the outbox table's oid as an `int4` ([`doorbell_lock`]),
/// so that the outboxes of several schemas in one database (advisory locks are one key space
/// per database: PostgreSQL docs, "Advisory Locks") each have their own. The outbox's insert
/// trigger (`outbox_events_notify()`, migration `2026-12-04-000014_doorbell_per_table`)
/// tries it in shared mode; an idle relay holds it exclusively on its `LISTEN` connection.
/// An application must not take these pairs itself (a transaction holding one in shared
/// mode delays an idle relay's wake-up by up to 50 ms per attempt; holding it exclusively
/// makes every insert notify).
pub const DOORBELL_LOCK: i32 = i32::from_be_bytes(*b"outb");

/// The first key of the busy lock, `'outB'` as a big-endian `int4`; the second is the outbox
/// table's oid as [`DOORBELL_LOCK`]'s ([`busy_lock`]). A relay whose workers claim batch
/// after batch holds it in shared mode on its `LISTEN` connection, and an idle relay of the
/// same outbox takes the doorbell only while no relay holds it. A busy relay claims what
/// commits (its workers claim again at once after each batch, and take the doorbell
/// themselves once they find nothing), so another relay's doorbell would only make every
/// commit notify, and wake that relay to claim beside the busy one: two relay instances at
/// one writer's pace notified at 0.65-0.98 of the commits without it (`relay_bench` figure
/// 11), as the idle instance took the doorbell whenever the busy one let it go. The same
/// reservation as [`DOORBELL_LOCK`]: an application must not take these pairs.
pub const BUSY_LOCK: i32 = i32::from_be_bytes(*b"outB");

/// The doorbell of the outbox table whose oid is `table` (`'outbox_events'::regclass`, the
/// insert trigger's `TG_RELID`), as the keys of `pg_advisory_lock(int4, int4)`:
/// ([`DOORBELL_LOCK`], the oid's 32 bits as an `int4`, as PostgreSQL's `oid::int4` casts it).
pub fn doorbell_lock(table: u32) -> (i32, i32) {
    (DOORBELL_LOCK, table.cast_signed())
}

/// The busy lock of the outbox table whose oid is `table`, as [`doorbell_lock`].
pub fn busy_lock(table: u32) -> (i32, i32) {
    (BUSY_LOCK, table.cast_signed())
}

/// The channel the insert trigger of the outbox table whose oid is `table` notifies while
/// its doorbell is armed: `outbox_events_` and the oid in decimal (`outbox_events_16392`),
/// at most 24 bytes, within PostgreSQL's 63 for an identifier. One per table, so that a
/// relay is not woken by another schema's outbox.
pub fn notification_channel(table: u32) -> String {
    format!("outbox_events_{table}")
}

/// The doorbell's statements for one outbox table, its oid in each of them.
pub(super) struct Statements {
    /// Listens on the table's [`notification_channel`], with the connection's `lock_timeout`
    /// set to [`ARM_ATTEMPT`].
    pub(super) listen: String,
    /// Arms the doorbell. It waits for the transactions that took the lock in shared mode,
    /// up to the listener connection's `lock_timeout`.
    pub(super) arm: String,
    /// Disarms it.
    pub(super) disarm: String,
    /// Takes the busy lock in shared mode without waiting: `false` while a relay probes it
    /// (`no_one_busy`).
    pub(super) busy: String,
    /// Releases the busy lock.
    pub(super) idle: String,
    /// Whether no relay is busy: the busy lock taken exclusively, without waiting, and
    /// released at once (`CASE` evaluates in order: PostgreSQL docs, "Expression Evaluation
    /// Rules").
    pub(super) no_one_busy: String,
    /// Whether no relay holds the doorbell or waits for it (its lock taken in shared mode,
    /// without waiting, and released at once): after an attempt to arm timed out, `true`
    /// means that inserting transactions held it up, not another relay.
    pub(super) no_other_relay: String,
}

impl Statements {
    pub(super) fn new(table: u32) -> Self {
        let (bell, key) = doorbell_lock(table);
        let (busy, _) = busy_lock(table);
        Self {
            listen: format!(
                "SET lock_timeout = {}; LISTEN {}",
                ARM_ATTEMPT.as_millis(),
                notification_channel(table)
            ),
            arm: format!("SELECT pg_advisory_lock({bell}, {key})"),
            disarm: format!("SELECT pg_advisory_unlock({bell}, {key})"),
            busy: format!("SELECT pg_try_advisory_lock_shared({busy}, {key}) AS granted"),
            idle: format!("SELECT pg_advisory_unlock_shared({busy}, {key})"),
            no_one_busy: format!(
                "SELECT CASE WHEN pg_try_advisory_lock({busy}, {key}) \
                 THEN pg_advisory_unlock({busy}, {key}) ELSE false END AS granted"
            ),
            no_other_relay: format!(
                "SELECT CASE WHEN pg_try_advisory_lock_shared({bell}, {key}) \
                 THEN pg_advisory_unlock_shared({bell}, {key}) ELSE false END AS granted"
            ),
        }
    }
}

/// How long one attempt to arm waits for the lock ([`Statements::arm`]): the inserting
/// transactions it waits for hold it from their outbox insert to their COMMIT, well under a
/// millisecond for a unit of work. The listener reads no notification while it waits.
pub(super) const ARM_ATTEMPT: Duration = Duration::from_millis(10);

/// How long the listener listens before it tries again to arm, after an attempt timed out:
/// another relay holds the doorbell (inserts notify it, and this relay too), or a transaction
/// holds the lock in shared mode for long (a plain `INSERT` into the outbox early in a long
/// transaction, or commits the disk holds up). In the second case the other transactions'
/// inserts meanwhile take the lock in shared mode too and notify no one, so after each
/// attempt that timed out a worker claims ([`Statements::no_other_relay`]): rows committed
/// meanwhile wait up to this long and an attempt, instead of the poll interval, for as long
/// as the lock is held.
pub(super) const ARM_RETRY: Duration = Duration::from_millis(40);

/// Batches in a row that claimed rows before a worker releases the doorbell
/// ([`Doorbell::busy`]).
pub(super) const SUSTAINED: u32 = 2;

/// What the workers want of the listener connection's locks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Want {
    /// Neither: the relay has just started, or all its workers back off.
    Nothing,
    /// The doorbell: the last worker awake found nothing to claim.
    Doorbell,
    /// The busy lock: a worker claimed rows in [`SUSTAINED`] batches in a row.
    Busy,
}

/// What an idle worker does next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Rest {
    /// Sleep until woken or the poll interval: a notification, or another worker, will see
    /// the rows that commit from now on.
    Sleep,
    /// Wait for the doorbell to be armed (or a wake-up), then claim once more.
    Arm,
}

/// Workers asleep (having chosen [`Rest::Sleep`], or [`resting`](Doorbell::resting)), and
/// of them those resting.
#[derive(Debug, Default)]
struct Counts {
    asleep: usize,
    resting: usize,
}

/// The doorbell's state in the relay: what the workers want, and whether the lock is held.
pub(super) struct Doorbell {
    workers: usize,
    /// Workers asleep, and of them those resting: one lock, so that a decision reads both
    /// as they are.
    counts: Mutex<Counts>,
    /// What the workers want of the locks; the listener follows it.
    wanted: watch::Sender<Want>,
    /// The epoch of the armed doorbell; 0 while it is not.
    armed: watch::Sender<u64>,
}

impl Doorbell {
    pub(super) fn new(workers: usize) -> Self {
        Self {
            workers,
            counts: Mutex::default(),
            wanted: watch::Sender::new(Want::Nothing),
            armed: watch::Sender::new(0),
        }
    }

    /// The epoch now: read it before a claim, and pass it to [`idle`](Self::idle) after.
    pub(super) fn epoch(&self) -> u64 {
        *self.armed.borrow()
    }

    /// A worker's claim, begun at `epoch`, found nothing. It may sleep when the doorbell was
    /// armed for the whole claim (every row the claim did not see is followed by a
    /// notification), or when another worker is awake (that one will claim, or arm the
    /// doorbell and claim, before it sleeps). The last one awake asks for the doorbell and
    /// must claim once more when it is armed.
    pub(super) fn idle(&self, epoch: u64) -> Rest {
        let mut counts = self.counts();
        let now = self.epoch();
        if (now != 0 && now == epoch) || counts.asleep + 1 < self.workers {
            counts.asleep += 1;
            return Rest::Sleep;
        }
        self.want(Want::Doorbell);
        Rest::Arm
    }

    /// A worker pauses without claiming (a backoff, a broker away) until the guard drops:
    /// it counts as asleep, so that an idle worker does not count on it to claim the rows
    /// that commit meanwhile, and takes the doorbell instead.
    ///
    /// When every worker rests, the relay can claim nothing: it lets the doorbell go, so
    /// that another relay can take it and be woken for the commits meanwhile (only the
    /// holder is woken: `listener`). Its workers ask for it again once one finds nothing to
    /// claim. So it does when the relay was busy and the others sleep: until one of them
    /// polls, it claims nothing, and its busy lock would keep another relay from the
    /// doorbell.
    pub(super) fn resting(&self) -> impl Drop + '_ {
        struct Resting<'a>(&'a Doorbell);
        impl Drop for Resting<'_> {
            fn drop(&mut self) {
                let mut counts = self.0.counts();
                counts.resting -= 1;
                counts.asleep = counts.asleep.saturating_sub(1);
            }
        }
        let mut counts = self.counts();
        counts.asleep += 1;
        counts.resting += 1;
        if counts.asleep == self.workers
            && (counts.resting == self.workers || *self.wanted.borrow() == Want::Busy)
        {
            self.want(Want::Nothing);
        }
        Resting(self)
    }

    /// A worker that chose [`Rest::Sleep`] woke.
    pub(super) fn awake(&self) {
        let mut counts = self.counts();
        counts.asleep = counts.asleep.saturating_sub(1);
    }

    fn counts(&self) -> std::sync::MutexGuard<'_, Counts> {
        // A poisoned lock only means a worker panicked holding it: the counts stand.
        self.counts.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A worker claimed rows in `streak` batches in a row, without waiting in between. From
    /// [`SUSTAINED`] on the relay is under load: it claims again at once after each batch
    /// and wakes the other workers, so inserts need not notify; the doorbell is released and
    /// the busy lock taken ([`BUSY_LOCK`]). A relay woken for a single batch goes back to
    /// sleep with the doorbell still armed, without releasing the lock and taking it again.
    pub(super) fn busy(&self, streak: u32) {
        if streak >= SUSTAINED {
            self.want(Want::Busy);
        }
    }

    fn want(&self, want: Want) {
        self.wanted
            .send_if_modified(|wanted| std::mem::replace(wanted, want) != want);
    }

    /// Completes once the doorbell is armed.
    pub(super) async fn armed(&self) {
        let mut armed = self.armed.subscribe();
        // The sender lives as long as `self`.
        let _ = armed.wait_for(|epoch| *epoch != 0).await;
    }

    /// For the listener: what the workers want.
    pub(super) fn wanted(&self) -> watch::Receiver<Want> {
        self.wanted.subscribe()
    }

    /// For the listener: the lock was granted; `epoch` is new and not 0.
    pub(super) fn set_armed(&self, epoch: u64) {
        debug_assert_ne!(epoch, 0);
        self.armed.send_replace(epoch);
    }

    /// For the listener: the lock is about to be released, or was lost with its connection.
    /// Called before the release, so that no worker trusts a doorbell that stops ringing.
    pub(super) fn set_disarmed(&self) {
        self.armed.send_replace(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_migration_names_the_same_keys_and_channel() {
        let sql = include_str!("../../migrations/2026-12-04-000014_doorbell_per_table/up.sql");
        let call = format!("pg_try_advisory_xact_lock_shared({DOORBELL_LOCK}, TG_RELID::int4)");
        assert!(sql.contains(&call), "{call} not in the migration");
        let notify = "pg_notify('outbox_events_' || TG_RELID, '')";
        assert!(sql.contains(notify), "{notify} not in the migration");
        assert_eq!(notification_channel(16_392), "outbox_events_16392");
        assert_eq!(DOORBELL_LOCK, 1_869_968_482);
        assert_ne!(BUSY_LOCK, DOORBELL_LOCK);
    }

    #[test]
    fn each_statement_names_its_tables_keys() {
        // An oid past i32::MAX, as PostgreSQL's `4000000000::oid::int4` gives it.
        let statements = Statements::new(4_000_000_000);
        assert_eq!(doorbell_lock(4_000_000_000), (DOORBELL_LOCK, -294_967_296));
        let bell = format!("({DOORBELL_LOCK}, -294967296)");
        let busy = format!("({BUSY_LOCK}, -294967296)");
        assert!(
            statements
                .listen
                .ends_with("LISTEN outbox_events_4000000000")
        );
        assert_eq!(statements.arm, format!("SELECT pg_advisory_lock{bell}"));
        assert_eq!(
            statements.disarm,
            format!("SELECT pg_advisory_unlock{bell}")
        );
        for sql in [&statements.busy, &statements.idle] {
            assert!(sql.contains(&busy), "{sql} does not name {busy}");
        }
        assert_eq!(statements.no_one_busy.matches(&busy).count(), 2);
        assert_eq!(statements.no_other_relay.matches(&bell).count(), 2);
    }

    #[test]
    fn only_the_last_worker_awake_asks_for_the_doorbell() {
        let doorbell = Doorbell::new(3);
        assert_eq!(doorbell.idle(0), Rest::Sleep);
        assert_eq!(doorbell.idle(0), Rest::Sleep);
        assert_eq!(doorbell.idle(0), Rest::Arm);
        assert_eq!(*doorbell.wanted().borrow(), Want::Doorbell);
        // Armed: the last worker claims once more; found nothing, it may sleep too.
        doorbell.set_armed(7);
        assert_eq!(doorbell.idle(7), Rest::Sleep);
        // One wakes and claims rows once: the doorbell stays; twice in a row: it goes.
        doorbell.awake();
        doorbell.busy(1);
        assert_eq!(*doorbell.wanted().borrow(), Want::Doorbell);
        doorbell.busy(SUSTAINED);
        assert_eq!(*doorbell.wanted().borrow(), Want::Busy);
    }

    #[test]
    fn a_relay_whose_workers_all_rest_lets_the_doorbell_go_until_one_finds_nothing() {
        let doorbell = Doorbell::new(2);
        assert_eq!(doorbell.idle(0), Rest::Sleep);
        assert_eq!(doorbell.idle(0), Rest::Arm);
        doorbell.set_armed(1);
        doorbell.awake();
        doorbell.awake();
        // One worker backs off: the other can still claim, the doorbell stays.
        let first = doorbell.resting();
        assert_eq!(*doorbell.wanted().borrow(), Want::Doorbell);
        // Both: nothing in this relay can claim.
        let second = doorbell.resting();
        assert_eq!(*doorbell.wanted().borrow(), Want::Nothing);
        doorbell.set_disarmed();
        drop((first, second));
        // Back, and finding nothing: the last one awake asks for it again.
        assert_eq!(doorbell.idle(0), Rest::Sleep);
        assert_eq!(doorbell.idle(0), Rest::Arm);
        assert_eq!(*doorbell.wanted().borrow(), Want::Doorbell);
    }

    #[test]
    fn a_busy_relay_whose_last_worker_awake_backs_off_gives_up_its_locks() {
        let doorbell = Doorbell::new(2);
        doorbell.busy(SUSTAINED);
        // One worker finds nothing and sleeps, counting on the other, which backs off.
        assert_eq!(doorbell.idle(0), Rest::Sleep);
        assert_eq!(*doorbell.wanted().borrow(), Want::Busy);
        let resting = doorbell.resting();
        assert_eq!(*doorbell.wanted().borrow(), Want::Nothing);
        drop(resting);
    }

    #[test]
    fn a_worker_backing_off_is_not_counted_on_to_claim() {
        let doorbell = Doorbell::new(2);
        let resting = doorbell.resting();
        assert_eq!(doorbell.idle(0), Rest::Arm);
        drop(resting);
        assert_eq!(doorbell.idle(0), Rest::Sleep);
    }

    #[test]
    fn a_claim_that_began_before_the_doorbell_was_armed_is_not_trusted() {
        let doorbell = Doorbell::new(1);
        assert_eq!(doorbell.idle(0), Rest::Arm);
        doorbell.set_armed(1);
        // The claim began at epoch 0: rows may have committed unnotified during it.
        assert_eq!(doorbell.idle(0), Rest::Arm);
        assert_eq!(doorbell.idle(1), Rest::Sleep);
        doorbell.awake();
        // Disarmed and armed again during a claim: another epoch, claim again.
        doorbell.set_disarmed();
        doorbell.set_armed(2);
        assert_eq!(doorbell.idle(1), Rest::Arm);
    }
}
