//! The inbox's statements on MySQL 8 and MariaDB 10.6+ (see `super::store` for what each
//! guarantees): PostgreSQL's functions `outbox_inbox_record` and `outbox_inbox_finish`,
//! written as the statements they run, in the transaction that applies the message.
//!
//! The consumer's position row is locked by the `INSERT ... ON DUPLICATE KEY UPDATE` that
//! creates it at first sight (an exclusive lock on the row, inserted or found: MySQL 8.0
//! Reference Manual, 17.7.3 "Locks Set by Different SQL Statements in InnoDB") and read
//! again with `FOR UPDATE`, a locking read, which sees the latest committed row, not the
//! transaction's snapshot: two instances applying one aggregate's events take turns, and the
//! second reads the first's position once it commits.

use std::time::Duration;

use diesel::QueryResult;
use diesel::mysql::Mysql;
use diesel::result::{DatabaseErrorKind, Error};
use diesel::sql_types::{BigInt, Text};
use diesel_async::{AsyncConnection, AsyncMysqlConnection, RunQueryDsl, SimpleAsyncConnection};

use super::portable::{self, keyed, keyed_aggregate};
use super::store::sealed::InboxStore;
use super::store::{
    Aggregate, ConsumerRow, DeadLetter, FailuresRow, MessageKey, Place, PositionRow, Recorded,
    Session,
};
use crate::database::{self, ConnectError, Kind};
use crate::unit_of_work::UnitOfWorkError;

/// The least time the server keeps an inbox session that sends no statement (`wait_timeout`):
/// a session whose host vanished mid-transaction (no FIN, no RST) holds its aggregate's
/// position lock until then, and the server's default is 8 hours. A live session is idle
/// between messages and while a handler works without the database, which it may do for
/// `handler_timeout`: a session's `wait_timeout` is the longer of this and the message's
/// longest wait ([`Session::idle_in_transaction`], `handler_timeout` plus
/// `statement_timeout`), as PostgreSQL's sessions set their
/// `idle_in_transaction_session_timeout` to it. A pooled connection the server closed is
/// replaced when the pool hands it out (diesel-async's pool checks each connection it
/// recycles).
const SESSION_WAIT_TIMEOUT: Duration = Duration::from_secs(60);

/// MySQL's and MariaDB's greatest `wait_timeout` (31,536,000 s, a year; MySQL docs, "Server
/// System Variables", wait_timeout): a longer `handler_timeout` (`Duration::MAX`, never) has
/// its sessions kept that long.
const MOST_WAIT_TIMEOUT: Duration = Duration::from_secs(31_536_000);

/// The `wait_timeout` of a session of `session`'s: [`SESSION_WAIT_TIMEOUT`], or the message's
/// longest wait where that is longer, in whole seconds rounded up, at most
/// [`MOST_WAIT_TIMEOUT`].
fn wait_timeout(session: &Session) -> Duration {
    let longest = session.idle_in_transaction;
    let whole = Duration::from_secs(
        longest
            .as_secs()
            .saturating_add(u64::from(longest.subsec_nanos() > 0)),
    );
    whole.clamp(SESSION_WAIT_TIMEOUT, MOST_WAIT_TIMEOUT)
}

/// Marks the transaction as the unit of work's again after [`InboxStore::finish`] released
/// the mark (`crate::mysql`'s `BEGIN` set it): the unit of work's flush checks it after.
const RENEW_MARK: &str = "RELEASE SAVEPOINT outbox_unit_of_work; SAVEPOINT outbox_unit_of_work";

/// Records the message for its consumer: `false` when it was recorded already (the primary
/// key's duplicate error, which ends only the statement, not the transaction).
async fn insert_message(conn: &mut AsyncMysqlConnection, key: MessageKey<'_>) -> QueryResult<bool> {
    let insert = keyed(
        portable::query("INSERT INTO outbox_inbox (consumer, source, message_id) VALUES (?, ?, ?)"),
        key,
    );
    match insert.execute(conn).await {
        Ok(_) => Ok(true),
        Err(Error::DatabaseError(DatabaseErrorKind::UniqueViolation, _)) => Ok(false),
        Err(error) => Err(error),
    }
}

async fn record(
    conn: &mut AsyncMysqlConnection,
    key: MessageKey<'_>,
    place: Option<Place<'_>>,
    accept_gap: bool,
) -> QueryResult<Recorded> {
    if !insert_message(conn, key).await? {
        return Ok(Recorded::Duplicate);
    }
    let Some(place) = place else {
        return Ok(Recorded::Next { previous_seq: None });
    };
    // The aggregate's row, created at "nothing applied" on first sight; locked either way.
    let create = portable::query(
        "INSERT INTO outbox_inbox_positions \
             (consumer, source, aggregate_type, aggregate_id, last_seq, stream_sequence) \
         VALUES (?, ?, ?, ?, 0, 0) ON DUPLICATE KEY UPDATE last_seq = last_seq",
    );
    keyed_aggregate(create, key, place).execute(conn).await?;
    let read = portable::query(
        "SELECT last_seq, stream_sequence FROM outbox_inbox_positions \
         WHERE consumer = ? AND source = ? AND aggregate_type = ? AND aggregate_id = ? \
         FOR UPDATE",
    );
    let position: portable::Position = keyed_aggregate(read, key, place).get_result(conn).await?;
    let recorded = position.recorded(place, accept_gap);
    if let Recorded::Next { .. } = recorded {
        portable::query(
            "UPDATE outbox_inbox_positions \
             SET last_seq = ?, stream_sequence = ?, updated_at = UTC_TIMESTAMP(6) \
             WHERE consumer = ? AND source = ? AND aggregate_type = ? AND aggregate_id = ?",
        )
        .bind::<BigInt, _>(place.seq)
        .bind::<BigInt, _>(place.stream_sequence)
        .bind::<Text, _>(key.consumer)
        .bind::<Text, _>(key.source)
        .bind::<Text, _>(place.aggregate_type)
        .bind::<Text, _>(place.aggregate_id)
        .execute(conn)
        .await?;
    }
    Ok(recorded)
}

async fn insert_dead_letter(
    conn: &mut AsyncMysqlConnection,
    letter: &DeadLetter<'_>,
) -> QueryResult<()> {
    portable::dead_letter(
        "INSERT INTO outbox_inbox_dead_letters (consumer, source, message_id, subject, \
             headers, payload, error, deliveries, stream_sequence) \
         VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) \
         ON DUPLICATE KEY UPDATE consumer = consumer",
        letter,
    )
    .execute(conn)
    .await?;
    Ok(())
}

#[allow(private_interfaces)]
impl InboxStore for AsyncMysqlConnection {
    super::store::deadpool_store!(AsyncMysqlConnection);

    const KIND: Kind = Kind::Mysql;

    /// Opens a session ([`wait_timeout`]) and turns MariaDB's idle transaction timeouts off
    /// for it ([`IDLE_TRANSACTION_TIMEOUTS`]), which an operator may set shorter than a
    /// handler that works without the database: the inbox cannot send its session a statement
    /// while the handler holds it, and the server would close it mid-message, every time the
    /// message is redelivered. Its `wait_timeout` bounds such a session instead, never shorter
    /// than `handler_timeout` plus `statement_timeout`: under the 60 s it was, a handler that
    /// worked longer without the database (within its 5-min default) lost its session at
    /// every delivery, and its message never settled.
    ///
    /// [`IDLE_TRANSACTION_TIMEOUTS`]: crate::mysql::IDLE_TRANSACTION_TIMEOUTS
    async fn connect(database_url: &str, session: &Session) -> Result<Self, ConnectError> {
        let mut conn =
            database::connect_mysql(database_url, session.limits, wait_timeout(session)).await?;
        let off = async {
            for (name, _) in crate::mysql::idle_transaction_timeouts(&mut conn).await? {
                conn.batch_execute(&format!("SET SESSION {name} = 0"))
                    .await?;
            }
            Ok::<_, Error>(())
        };
        database::bounded_setup(
            session.limits.statement_timeout,
            &database::redacted(database_url),
            "turning idle_transaction_timeout off",
            off,
        )
        .await?;
        Ok(conn)
    }

    async fn record(
        &mut self,
        key: MessageKey<'_>,
        place: Option<Place<'_>>,
        accept_gap: bool,
    ) -> QueryResult<Recorded> {
        record(self, key, place, accept_gap).await
    }

    async fn finish(
        &mut self,
        key: MessageKey<'_>,
        clear_attempts: bool,
    ) -> Result<(), UnitOfWorkError> {
        // A COMMIT or ROLLBACK by the handler (or a statement that commits implicitly) ended
        // the transaction and its savepoints: releasing the mark fails.
        crate::mysql::released(self.batch_execute(RENEW_MARK).await)?;
        if clear_attempts {
            keyed(
                portable::query(
                    "DELETE FROM outbox_inbox_attempts \
                     WHERE consumer = ? AND source = ? AND message_id = ?",
                ),
                key,
            )
            .execute(self)
            .await?;
        }
        Ok(())
    }

    async fn count_failure(&mut self, key: MessageKey<'_>, error: &str) -> QueryResult<u32> {
        let failures = self
            .transaction::<_, Error, _>(async |conn| {
                keyed(
                    portable::query(
                        "INSERT INTO outbox_inbox_attempts \
                             (consumer, source, message_id, failures, last_error) \
                         VALUES (?, ?, ?, 1, ?) ON DUPLICATE KEY UPDATE \
                             failures = failures + 1, last_error = ?, \
                             failed_at = UTC_TIMESTAMP(6)",
                    ),
                    key,
                )
                .bind::<Text, _>(error)
                .bind::<Text, _>(error)
                .execute(conn)
                .await?;
                let row: FailuresRow = keyed(
                    portable::query(
                        "SELECT failures FROM outbox_inbox_attempts \
                         WHERE consumer = ? AND source = ? AND message_id = ?",
                    ),
                    key,
                )
                .get_result(conn)
                .await?;
                Ok(row.count())
            })
            .await?;
        Ok(failures)
    }

    async fn insert_dead_letter(&mut self, letter: &DeadLetter<'_>) -> QueryResult<()> {
        insert_dead_letter(self, letter).await
    }

    async fn dead_letter_alone(&mut self, letter: &DeadLetter<'_>) -> QueryResult<()> {
        self.transaction::<_, Error, _>(async |conn| {
            insert_message(conn, letter.key).await?;
            insert_dead_letter(conn, letter).await
        })
        .await
    }

    async fn insert_gap(
        &mut self,
        key: MessageKey<'_>,
        place: Place<'_>,
        after_seq: i64,
        reason: &str,
    ) -> QueryResult<()> {
        portable::gap(key, place, after_seq, reason)
            .execute(self)
            .await?;
        Ok(())
    }

    async fn settled(
        &mut self,
        consumer: &str,
        source: &str,
        message_id: Option<&str>,
        stream_sequence: u64,
    ) -> QueryResult<bool> {
        let row: portable::Settled =
            portable::settled(consumer, source, message_id, stream_sequence)
                .get_result(self)
                .await?;
        Ok(row.settled())
    }

    async fn positions(
        &mut self,
        consumer: &str,
        aggregates: &[Aggregate],
    ) -> QueryResult<Vec<(Aggregate, i64)>> {
        if aggregates.is_empty() {
            return Ok(Vec::new());
        }
        // One primary-key lookup per aggregate (a few dozen at most: the parked ones).
        let tuples = vec!["(?, ?, ?)"; aggregates.len()].join(", ");
        let mut lookup = diesel::sql_query(format!(
            "SELECT CAST(source AS CHAR) AS source, CAST(aggregate_type AS CHAR) AS aggregate_type, \
                 CAST(aggregate_id AS CHAR) AS aggregate_id, last_seq \
             FROM outbox_inbox_positions \
             WHERE consumer = ? AND (source, aggregate_type, aggregate_id) IN ({tuples})"
        ))
        .into_boxed::<Mysql>()
        .bind::<Text, _>(consumer);
        for aggregate in aggregates {
            lookup = lookup
                .bind::<Text, _>(aggregate.source.as_str())
                .bind::<Text, _>(aggregate.aggregate_type.as_str())
                .bind::<Text, _>(aggregate.aggregate_id.as_str());
        }
        let rows: Vec<PositionRow> = lookup.load(self).await?;
        Ok(rows.into_iter().map(PositionRow::into_position).collect())
    }

    async fn purge(
        &mut self,
        consumer: &str,
        older_than: Duration,
        limit: i64,
    ) -> QueryResult<usize> {
        // Past DATETIME's range (before year 1000) the cutoff is NULL: nothing is older.
        let age_us = crate::outbox::purge::age_millis(older_than).saturating_mul(1_000);
        portable::query(
            "DELETE FROM outbox_inbox_attempts WHERE consumer = ? \
                 AND failed_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND LIMIT ?",
        )
        .bind::<Text, _>(consumer)
        .bind::<BigInt, _>(age_us)
        .bind::<BigInt, _>(limit)
        .execute(self)
        .await?;
        portable::query(
            "DELETE FROM outbox_inbox WHERE consumer = ? \
                 AND handled_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND \
             ORDER BY handled_at LIMIT ?",
        )
        .bind::<Text, _>(consumer)
        .bind::<BigInt, _>(age_us)
        .bind::<BigInt, _>(limit)
        .execute(self)
        .await
    }

    async fn consumers(&mut self) -> QueryResult<Vec<String>> {
        // A loose index scan of the primary key ("Using index for group-by").
        let rows: Vec<ConsumerRow> = portable::query(
            "SELECT CAST(consumer AS CHAR) AS consumer FROM outbox_inbox \
             GROUP BY consumer ORDER BY consumer",
        )
        .load(self)
        .await?;
        Ok(rows.into_iter().map(|row| row.consumer).collect())
    }

    async fn lacking_privileges(&mut self) -> QueryResult<Option<String>> {
        use crate::privileges::{Component, PrivilegedConnection};
        self.lacking_for(Component::InboxConsumer).await
    }

    async fn has_positions(&mut self, consumer: &str) -> QueryResult<bool> {
        let row: portable::Settled = portable::has_positions(consumer).get_result(self).await?;
        Ok(row.settled())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sessions_wait_timeout_outlasts_a_handler_that_works_without_the_database() {
        let wait = |handler: Duration, statement: Duration| {
            let mut config = crate::InboxConfig::new("billing", "mysql://app@db/orders");
            config.handler_timeout = handler;
            config.statement_timeout = statement;
            wait_timeout(&Session::of(&config))
        };
        let seconds = Duration::from_secs;
        // The defaults: 5 min and 30 s.
        assert_eq!(wait(seconds(300), seconds(30)), seconds(330));
        assert_eq!(wait(seconds(2), seconds(1)), SESSION_WAIT_TIMEOUT);
        assert_eq!(
            wait(Duration::from_millis(90_400), seconds(30)),
            seconds(121)
        );
        assert_eq!(wait(Duration::MAX, seconds(30)), MOST_WAIT_TIMEOUT);
    }
}
