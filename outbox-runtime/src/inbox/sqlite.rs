//! The inbox's statements on SQLite (see `super::store` for what each guarantees):
//! PostgreSQL's functions `outbox_inbox_record` and `outbox_inbox_finish`, written as the
//! statements they run, in the transaction that applies the message.
//!
//! That transaction is the unit of work's `BEGIN IMMEDIATE`: it holds SQLite's one write
//! lock from its first statement, so the read of the consumer's position and its move are
//! atomic, and the instances of a consumer apply their messages one transaction at a time
//! (the order PostgreSQL's row lock gives one aggregate, for the whole file). The inbox's
//! own transactions outside it (a failure's count, a dead letter out of order, retention)
//! take the write lock the same way ([`crate::sqlite::begin_immediate`]).

use std::time::Duration;

use diesel::QueryResult;
use diesel::result::Error;
use diesel::sql_types::{BigInt, Text};
use diesel::sqlite::Sqlite;
use diesel_async::{AsyncConnection, RunQueryDsl, SimpleAsyncConnection, TransactionManager};

use super::portable::{self, keyed, keyed_aggregate};
use super::store::sealed::InboxStore;
use super::store::{
    Aggregate, ConsumerRow, DeadLetter, FailuresRow, MessageKey, Place, PositionRow, Recorded,
    Session,
};
use crate::database::{self, ConnectError, Kind};
use crate::sqlite::AsyncSqliteConnection;
use crate::unit_of_work::UnitOfWorkError;

/// Marks the transaction as the unit of work's again after [`InboxStore::finish`] released
/// the mark (`crate::sqlite::begin` set it): the unit of work's flush checks it after.
const RENEW_MARK: &str = "RELEASE outbox_unit_of_work; SAVEPOINT outbox_unit_of_work";

/// Runs `body` in a `BEGIN IMMEDIATE` transaction of its own, which waits for the write
/// lock as units of work do: committed when it returns `Ok`, rolled back otherwise.
async fn immediately<R>(
    conn: &mut AsyncSqliteConnection,
    body: impl AsyncFnOnce(&mut AsyncSqliteConnection) -> QueryResult<R>,
) -> QueryResult<R> {
    type Manager = <AsyncSqliteConnection as AsyncConnection>::TransactionManager;
    conn.spawn_blocking(|conn| crate::sqlite::begin_immediate(conn, "BEGIN IMMEDIATE"))
        .await?;
    match body(conn).await {
        Ok(value) => {
            Manager::commit_transaction(conn).await?;
            Ok(value)
        }
        Err(error) => {
            let _ = Manager::rollback_transaction(conn).await;
            Err(error)
        }
    }
}

/// Records the message for its consumer: `false` when it was recorded already.
async fn insert_message(
    conn: &mut AsyncSqliteConnection,
    key: MessageKey<'_>,
) -> QueryResult<bool> {
    let inserted = keyed(
        portable::query(
            "INSERT INTO outbox_inbox (consumer, source, message_id) VALUES (?, ?, ?) \
             ON CONFLICT DO NOTHING",
        ),
        key,
    )
    .execute(conn)
    .await?;
    Ok(inserted == 1)
}

async fn record(
    conn: &mut AsyncSqliteConnection,
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
    // The aggregate's row, created at "nothing applied" on first sight.
    let position: portable::Position = keyed_aggregate(
        portable::query(
            "INSERT INTO outbox_inbox_positions \
                 (consumer, source, aggregate_type, aggregate_id, last_seq, stream_sequence) \
             VALUES (?, ?, ?, ?, 0, 0) \
             ON CONFLICT DO UPDATE SET last_seq = last_seq \
             RETURNING last_seq, stream_sequence",
        ),
        key,
        place,
    )
    .get_result(conn)
    .await?;
    let recorded = position.recorded(place, accept_gap);
    if let Recorded::Next { .. } = recorded {
        portable::query(
            "UPDATE outbox_inbox_positions \
             SET last_seq = ?, stream_sequence = ?, \
                 updated_at = strftime('%Y-%m-%d %H:%M:%f', 'now') \
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
    conn: &mut AsyncSqliteConnection,
    letter: &DeadLetter<'_>,
) -> QueryResult<()> {
    portable::dead_letter(
        "INSERT INTO outbox_inbox_dead_letters (consumer, source, message_id, subject, \
             headers, payload, error, deliveries, stream_sequence) \
         VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
        letter,
    )
    .execute(conn)
    .await?;
    Ok(())
}

#[allow(private_interfaces)]
impl InboxStore for AsyncSqliteConnection {
    super::store::deadpool_store!(AsyncSqliteConnection);

    const KIND: Kind = Kind::Sqlite;

    async fn connect(database_url: &str, session: &Session) -> Result<Self, ConnectError> {
        database::connect_sqlite(database_url, session.limits)
            .await
            .map(AsyncSqliteConnection::new)
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
        // A COMMIT or ROLLBACK by the handler ended the transaction and its savepoints:
        // releasing the mark fails (SQLite docs, "SAVEPOINT").
        match self.batch_execute(RENEW_MARK).await {
            Ok(()) => {}
            Err(Error::DatabaseError(_, info))
                if info.message().starts_with("no such savepoint") =>
            {
                return Err(UnitOfWorkError::TransactionEnded);
            }
            Err(error) => return Err(UnitOfWorkError::Database(error)),
        }
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
        let row: FailuresRow = immediately(self, async |conn| {
            keyed(
                portable::query(
                    "INSERT INTO outbox_inbox_attempts \
                         (consumer, source, message_id, failures, last_error) \
                     VALUES (?, ?, ?, 1, ?) ON CONFLICT DO UPDATE \
                     SET failures = failures + 1, last_error = excluded.last_error, \
                         failed_at = strftime('%Y-%m-%d %H:%M:%f', 'now') \
                     RETURNING failures",
                ),
                key,
            )
            .bind::<Text, _>(error)
            .get_result(conn)
            .await
        })
        .await?;
        Ok(row.count())
    }

    async fn insert_dead_letter(&mut self, letter: &DeadLetter<'_>) -> QueryResult<()> {
        insert_dead_letter(self, letter).await
    }

    async fn dead_letter_alone(&mut self, letter: &DeadLetter<'_>) -> QueryResult<()> {
        immediately(self, async |conn| {
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
            "SELECT p.source, p.aggregate_type, p.aggregate_id, p.last_seq \
             FROM (VALUES {tuples}) AS w \
             JOIN outbox_inbox_positions p ON p.consumer = ? AND p.source = w.column1 \
               AND p.aggregate_type = w.column2 AND p.aggregate_id = w.column3"
        ))
        .into_boxed::<Sqlite>();
        for aggregate in aggregates {
            lookup = lookup
                .bind::<Text, _>(aggregate.source.as_str())
                .bind::<Text, _>(aggregate.aggregate_type.as_str())
                .bind::<Text, _>(aggregate.aggregate_id.as_str());
        }
        let rows: Vec<PositionRow> = lookup.bind::<Text, _>(consumer).load(self).await?;
        Ok(rows.into_iter().map(PositionRow::into_position).collect())
    }

    async fn purge(
        &mut self,
        consumer: &str,
        older_than: Duration,
        limit: i64,
    ) -> QueryResult<usize> {
        // A modifier of whole seconds and a fraction (SQLite docs, "Date And Time
        // Functions"); out of the calendar the cutoff is NULL: nothing is older.
        let ms = crate::outbox::purge::age_millis(older_than);
        let modifier = format!("-{}.{:03} seconds", ms / 1_000, ms % 1_000);
        immediately(self, async |conn| {
            portable::query(
                "DELETE FROM outbox_inbox_attempts WHERE rowid IN ( \
                     SELECT rowid FROM outbox_inbox_attempts WHERE consumer = ? \
                     AND failed_at < strftime('%Y-%m-%d %H:%M:%f', 'now', ?) LIMIT ?)",
            )
            .bind::<Text, _>(consumer)
            .bind::<Text, _>(modifier.as_str())
            .bind::<BigInt, _>(limit)
            .execute(conn)
            .await?;
            portable::query(
                "DELETE FROM outbox_inbox WHERE (consumer, source, message_id) IN ( \
                     SELECT consumer, source, message_id FROM outbox_inbox WHERE consumer = ? \
                     AND handled_at < strftime('%Y-%m-%d %H:%M:%f', 'now', ?) \
                     ORDER BY handled_at LIMIT ?)",
            )
            .bind::<Text, _>(consumer)
            .bind::<Text, _>(modifier.as_str())
            .bind::<BigInt, _>(limit)
            .execute(conn)
            .await
        })
        .await
    }

    async fn consumers(&mut self) -> QueryResult<Vec<String>> {
        let rows: Vec<ConsumerRow> =
            portable::query("SELECT DISTINCT consumer FROM outbox_inbox ORDER BY consumer")
                .load(self)
                .await?;
        Ok(rows.into_iter().map(|row| row.consumer).collect())
    }

    async fn has_positions(&mut self, consumer: &str) -> QueryResult<bool> {
        let row: portable::Settled = portable::has_positions(consumer).get_result(self).await?;
        Ok(row.settled())
    }
}
