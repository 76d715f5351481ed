//! The relay's wake-up: a dedicated connection that `LISTEN`s on its outbox table's channel
//! and rings the [doorbell](super::doorbell).
//!
//! The outbox's insert trigger calls `pg_notify('outbox_events_' || TG_RELID, '')` while the
//! doorbell is armed (the [channel](doorbell::notification_channel) and the doorbell's locks
//! are keyed by the table's oid: several schemas of a database may each hold an outbox);
//! PostgreSQL delivers the notification when the inserting transaction commits and drops it
//! when it rolls back (PostgreSQL docs, NOTIFY), so a notification means committed rows.
//! While the relay holds the doorbell, each one wakes every worker; a worker woken while busy
//! keeps the wake-up for its next wait, so none is lost between a notification and the
//! worker's next claim. A relay that does not hold it ignores notifications: they ring for
//! the relay that does (every listener of the channel receives every notification), and a
//! relay that waits for the doorbell, or is busy and claims anyway, would only claim beside the
//! holder and find nothing.
//!
//! The same connection holds the doorbell's advisory lock, taken and released as the
//! workers ask: a session-level lock needs no open transaction, and it goes with the
//! connection, which the listener notices as it notices lost notifications.
//!
//! Notifications are an accelerator, not the mechanism: when the connection drops the
//! listener reconnects with backoff and, once listening again, wakes the workers (rows may
//! have committed while nobody listened: notified for this relay's doorbell until the server
//! noticed the dropped connection, and ignored by the other relays). Meanwhile the workers
//! poll. The first connection wakes nobody: the workers claim as they start, and what commits
//! after a worker's first claim is claimed once the doorbell is armed, or rings for the relay
//! that holds it, or is claimed by a busy relay (a wake-up would only have each worker claim
//! twice at start, the second time for nothing).

use std::sync::Arc;

use diesel::result::DatabaseErrorKind;
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use futures::StreamExt;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::doorbell::{self, Doorbell, Statements, Want};
use super::{Backoff, Shared};
use crate::database::{self, Bounded};

pub(super) async fn run(
    shared: &Shared,
    wakers: Vec<Arc<Notify>>,
    doorbell: &Doorbell,
    stop: CancellationToken,
) {
    let wake_all = || wakers.iter().for_each(|wake| wake.notify_one());
    let mut backoff = Backoff::new(shared.config.max_backoff);
    let mut wanted = doorbell.wanted();
    let mut epoch = 0_u64;
    let mut listened = false;
    while !stop.is_cancelled() {
        match listen(shared).await {
            Ok((mut conn, statements)) => {
                backoff.reset();
                if listened {
                    wake_all();
                }
                listened = true;
                let mut locks = Locks {
                    doorbell: false,
                    busy: false,
                    want: Want::Nothing,
                    attempt_at: tokio::time::Instant::now(),
                };
                loop {
                    let want = *wanted.borrow_and_update();
                    if let Err(error) = follow(
                        shared,
                        (&mut conn, &statements),
                        doorbell,
                        &wakers,
                        want,
                        &mut locks,
                        &mut epoch,
                    )
                    .await
                    {
                        tracing::warn!(%error, "the relay's LISTEN connection failed; polling until it is back");
                        break;
                    }
                    // An attempt that failed is retried after ARM_RETRY of listening.
                    let holding = locks.doorbell;
                    let retry = match want {
                        Want::Doorbell => !locks.doorbell,
                        Want::Busy => !locks.busy,
                        Want::Nothing => false,
                    };
                    let attempt_at = locks.attempt_at;
                    let mut notifications = std::pin::pin!(conn.notifications_stream());
                    tokio::select! {
                        biased;
                        () = stop.cancelled() => {
                            doorbell.set_disarmed();
                            return;
                        }
                        notification = notifications.next() => match notification {
                            // Only the relay holding the doorbell is woken: another relay
                            // that waits for it (or a busy one, which claims anyway) would
                            // claim beside the holder and find nothing.
                            Some(Ok(_)) if holding => {
                                metrics::counter!("outbox_relay_notifications_total").increment(1);
                                wake_all();
                            }
                            Some(Ok(_)) => {}
                            Some(Err(error)) => {
                                tracing::warn!(%error, "the relay's LISTEN connection failed; polling until it is back");
                                break;
                            }
                            None => {
                                tracing::warn!("the relay's LISTEN connection closed; polling until it is back");
                                break;
                            }
                        },
                        _ = wanted.changed() => {}
                        () = tokio::time::sleep_until(attempt_at), if retry => {}
                    }
                }
                // The lock went with the connection, or will when the server notices.
                doorbell.set_disarmed();
            }
            Err(error) => {
                tracing::warn!(%error, "the relay cannot LISTEN; polling until it can");
            }
        }
        tokio::select! {
            biased;
            () = stop.cancelled() => return,
            () = tokio::time::sleep(backoff.next()) => {}
        }
    }
}

/// The listener connection's advisory locks, and when a failed attempt may be made again.
struct Locks {
    /// The doorbell, held exclusively: the relay waits for rows.
    doorbell: bool,
    /// The busy lock, held in shared mode: the relay claims batch after batch.
    busy: bool,
    /// What the workers wanted when last followed.
    want: Want,
    attempt_at: tokio::time::Instant,
}

/// Takes and releases the listener connection's locks as the workers `want`:
///
/// - [`Want::Doorbell`]: the busy lock goes; the doorbell is taken unless another relay is
///   busy (it claims what commits, and a doorbell rung for this relay would only make every
///   commit notify) or holds it, in which case the attempt is made again after
///   [`doorbell::ARM_RETRY`]; when inserting transactions held the attempt up rather than
///   another relay, one of `wakers` claims meanwhile, since the commits of that time
///   notified no one;
/// - [`Want::Busy`]: the doorbell goes, the busy lock is taken (shared with other busy
///   relays; a relay probing it holds it exclusively for an instant, then the attempt is
///   made again);
/// - [`Want::Nothing`]: both go, so another relay takes the doorbell.
async fn follow(
    shared: &Shared,
    (conn, statements): (&mut AsyncPgConnection, &Statements),
    doorbell: &Doorbell,
    wakers: &[Arc<Notify>],
    want: Want,
    locks: &mut Locks,
    epoch: &mut u64,
) -> Result<(), LockError> {
    if want != Want::Doorbell && locks.doorbell {
        doorbell.set_disarmed();
        locks.doorbell = false;
        lock_statement(
            shared,
            conn,
            "disarming the relay's doorbell",
            &statements.disarm,
        )
        .await?;
    }
    if want != Want::Busy && locks.busy {
        locks.busy = false;
        lock_statement(
            shared,
            conn,
            "releasing the relay's busy lock",
            &statements.idle,
        )
        .await?;
    }
    let now = tokio::time::Instant::now();
    if want != locks.want {
        // A new wish is acted on at once, whatever a failed attempt at the last one said.
        locks.want = want;
        locks.attempt_at = now;
    }
    if now < locks.attempt_at {
        return Ok(());
    }
    match want {
        Want::Doorbell if !locks.doorbell => {
            if !granted(
                shared,
                conn,
                "probing for busy relays",
                &statements.no_one_busy,
            )
            .await?
            {
                locks.attempt_at = now + doorbell::ARM_RETRY;
            } else if arm(shared, conn, &statements.arm).await? {
                locks.doorbell = true;
                *epoch += 1;
                doorbell.set_armed(*epoch);
                metrics::counter!("outbox_relay_doorbell_armed_total").increment(1);
            } else {
                locks.attempt_at = now + doorbell::ARM_RETRY;
                // When no other relay holds the doorbell, transactions that took its lock in
                // shared mode held the attempt up, and the inserts committed meanwhile
                // notified no one: a worker claims them now, rather than at its poll. (A
                // relay that holds the doorbell is woken by them; claiming beside it would
                // find nothing.)
                if granted(
                    shared,
                    conn,
                    "probing for another relay's doorbell",
                    &statements.no_other_relay,
                )
                .await?
                    && let Some(waker) = wakers.first()
                {
                    waker.notify_one();
                }
            }
        }
        Want::Busy if !locks.busy => {
            if granted(
                shared,
                conn,
                "taking the relay's busy lock",
                &statements.busy,
            )
            .await?
            {
                locks.busy = true;
            } else {
                locks.attempt_at = now + doorbell::ARM_RETRY;
            }
        }
        _ => {}
    }
    Ok(())
}

/// Runs `sql`, a `SELECT` of one boolean named `granted`.
async fn granted(
    shared: &Shared,
    conn: &mut AsyncPgConnection,
    operation: &'static str,
    sql: &str,
) -> Result<bool, LockError> {
    #[derive(diesel::QueryableByName)]
    struct Granted {
        #[diesel(sql_type = diesel::sql_types::Bool)]
        granted: bool,
    }
    database::bounded(
        shared.config.statement_timeout,
        &shared.target,
        operation,
        diesel::sql_query(sql).get_result::<Granted>(conn),
    )
    .await
    .map(|row| row.granted)
}

/// Opens the listener connection, finds the oid of the outbox table it sees (its
/// `search_path` chooses the schema, as for the relay's claims), and listens on that table's
/// channel with the statements of its doorbell.
async fn listen(shared: &Shared) -> Result<(AsyncPgConnection, Statements), String> {
    #[derive(diesel::QueryableByName)]
    struct Table {
        #[diesel(sql_type = diesel::sql_types::Oid)]
        oid: u32,
    }
    let mut conn = super::worker::connect(shared)
        .await
        .map_err(|e| e.to_string())?;
    let table = database::bounded_setup(
        shared.config.statement_timeout,
        &shared.target,
        "finding the outbox table's oid",
        diesel::sql_query(TABLE_OID).get_result::<Table>(&mut conn),
    )
    .await
    .map_err(|e| e.to_string())?;
    let statements = Statements::new(table.oid);
    database::bounded(
        shared.config.statement_timeout,
        &shared.target,
        "the relay's LISTEN",
        conn.batch_execute(&statements.listen),
    )
    .await
    .map_err(|e| e.to_string())?;
    Ok((conn, statements))
}

/// The oid of the `outbox_events` table the connection's `search_path` finds: the key of its
/// doorbell and its channel ([`doorbell::doorbell_lock`]).
const TABLE_OID: &str = "SELECT 'outbox_events'::regclass::oid AS oid";

/// One attempt to take the doorbell's lock: `Ok(false)` when the server refused it this time
/// (its `lock_timeout`: transactions hold the lock in shared mode, or another relay holds
/// it); an error when the connection failed or did not answer.
async fn arm(shared: &Shared, conn: &mut AsyncPgConnection, sql: &str) -> Result<bool, LockError> {
    match lock_statement(shared, conn, "arming the relay's doorbell", sql).await {
        Ok(()) => Ok(true),
        // The server answered, so the connection stands. Told by kind, not by the message
        // text, which the server's `lc_messages` may translate.
        Err(Bounded::Failed(diesel::result::Error::DatabaseError(kind, _)))
            if !matches!(kind, DatabaseErrorKind::ClosedConnection) =>
        {
            Ok(false)
        }
        Err(error) => Err(error),
    }
}

/// Why a doorbell statement failed.
type LockError = Bounded<diesel::result::Error>;

async fn lock_statement(
    shared: &Shared,
    conn: &mut AsyncPgConnection,
    operation: &'static str,
    sql: &str,
) -> Result<(), LockError> {
    database::bounded(
        shared.config.statement_timeout,
        &shared.target,
        operation,
        diesel::sql_query(sql).execute(conn),
    )
    .await
    .map(drop)
}
