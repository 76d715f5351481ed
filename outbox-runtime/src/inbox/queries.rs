//! The inbox's statements on PostgreSQL: the functions `outbox_inbox_record` and
//! `outbox_inbox_finish` of the migrations, and plain statements (see `super::store` for
//! what each guarantees).

use diesel::sql_types::{Array, Bool, Bytea, Int8, Jsonb, Nullable, Text};
use diesel::{QueryResult, QueryableByName};
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use super::store::sealed::InboxStore;
use super::store::{
    Aggregate, ConsumerRow, DeadLetter, FailuresRow, MessageKey, Place, PositionRow, Recorded,
    Session, unread_id,
};
use crate::database::{self, ConnectError, Kind};
use crate::outbox::statement::statement;
use crate::unit_of_work::UnitOfWorkError;

statement! {
    /// The inbox's first statement (see [`record`]): the function `outbox_inbox_record` of
    /// the migrations, planned once per session.
    struct RecordMessage<'a> {
        consumer: &'a str => Text,
        source: &'a str => Text,
        message_id: &'a str => Text,
        aggregate_type: Option<&'a str> => Nullable<Text>,
        aggregate_id: Option<&'a str> => Nullable<Text>,
        seq: Option<i64> => Nullable<Int8>,
        stream_sequence: Option<i64> => Nullable<Int8>,
        accept_gap: bool => Bool,
    }
    sql = "SELECT recorded, previous_seq, previous_stream_sequence, moved \
           FROM outbox_inbox_record($1, $2, $3, $4, $5, $6, $7, $8)";
}

#[derive(QueryableByName)]
struct RecordRow {
    #[diesel(sql_type = Bool)]
    recorded: bool,
    #[diesel(sql_type = Nullable<Int8>)]
    previous_seq: Option<i64>,
    #[diesel(sql_type = Nullable<Int8>)]
    previous_stream_sequence: Option<i64>,
    #[diesel(sql_type = Nullable<Bool>)]
    moved: Option<bool>,
}

/// Records the message and, when `place` is given, moves the consumer's position in the
/// aggregate to it if it is the next one (or if `accept_gap`, when the caller has found that
/// the events in between will not come).
async fn record(
    conn: &mut AsyncPgConnection,
    key: MessageKey<'_>,
    place: Option<Place<'_>>,
    accept_gap: bool,
) -> QueryResult<Recorded> {
    let row: RecordRow = RecordMessage {
        consumer: key.consumer,
        source: key.source,
        message_id: key.message_id,
        aggregate_type: place.map(|p| p.aggregate_type),
        aggregate_id: place.map(|p| p.aggregate_id),
        seq: place.map(|p| p.seq),
        stream_sequence: place.map(|p| p.stream_sequence),
        accept_gap,
    }
    .get_result(conn)
    .await?;
    if !row.recorded {
        return Ok(Recorded::Duplicate);
    }
    let (Some(place), Some(last_seq), Some(moved)) = (place, row.previous_seq, row.moved) else {
        return Ok(Recorded::Next { previous_seq: None });
    };
    if moved {
        // The function reads the previous stream sequence only when it did not move.
        return Ok(Recorded::Next {
            previous_seq: Some(last_seq),
        });
    }
    if last_seq >= place.seq {
        return Ok(Recorded::Late { last_seq });
    }
    let stream_sequence = row.previous_stream_sequence.ok_or_else(|| {
        diesel::result::Error::DeserializationError(
            "outbox_inbox_record found a gap and returned no stream sequence".into(),
        )
    })?;
    Ok(Recorded::Gap {
        last_seq,
        stream_sequence,
    })
}

statement! {
    /// The inbox's last statement before COMMIT (see [`finish`]), sent for a message
    /// delivered before (its failed attempts are forgotten); otherwise the outbox's flush or
    /// the unit of work's checking COMMIT makes the same check.
    struct Finish<'a> {
        consumer: &'a str => Text,
        source: &'a str => Text,
        message_id: &'a str => Text,
        clear_attempts: bool => Bool,
    }
    sql = "SELECT outbox_inbox_finish($1, $2, $3, $4)";
}

/// Checks that the transaction is still the inbox's own (the handler did not end it), and
/// forgets the message's failed attempts when `clear_attempts`.
async fn finish(
    conn: &mut AsyncPgConnection,
    key: MessageKey<'_>,
    clear_attempts: bool,
) -> QueryResult<()> {
    Finish {
        consumer: key.consumer,
        source: key.source,
        message_id: key.message_id,
        clear_attempts,
    }
    .execute(conn)
    .await?;
    Ok(())
}

statement! {
    /// One more handler failure of a message (see [`count_failure`]).
    struct CountFailure<'a> {
        consumer: &'a str => Text,
        source: &'a str => Text,
        message_id: &'a str => Text,
        error: &'a str => Text,
    }
    sql = "INSERT INTO outbox_inbox_attempts AS a (consumer, source, message_id, failures, last_error) \
           VALUES ($1, $2, $3, 1, $4) \
           ON CONFLICT (consumer, source, message_id) DO UPDATE \
           SET failures = a.failures + 1, last_error = excluded.last_error, failed_at = now() \
           RETURNING failures";
}

/// Counts a handler failure of the message, outside any transaction of it; returns the
/// failures so far.
async fn count_failure(
    conn: &mut AsyncPgConnection,
    key: MessageKey<'_>,
    error: &str,
) -> QueryResult<u32> {
    let row: FailuresRow = CountFailure {
        consumer: key.consumer,
        source: key.source,
        message_id: key.message_id,
        error,
    }
    .get_result(conn)
    .await?;
    Ok(row.count())
}

/// Writes a dead letter, in the caller's transaction (which also records the message, so a
/// later delivery of it is skipped).
async fn insert_dead_letter(
    conn: &mut AsyncPgConnection,
    letter: &DeadLetter<'_>,
) -> QueryResult<()> {
    diesel::sql_query(
        "INSERT INTO outbox_inbox_dead_letters (consumer, source, message_id, subject, headers, \
             payload, error, deliveries, stream_sequence) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) ON CONFLICT DO NOTHING",
    )
    .bind::<Text, _>(letter.key.consumer)
    .bind::<Text, _>(letter.key.source)
    .bind::<Text, _>(letter.key.message_id)
    .bind::<Text, _>(letter.subject)
    .bind::<Jsonb, _>(letter.headers)
    .bind::<Bytea, _>(letter.payload)
    .bind::<Text, _>(letter.error)
    .bind::<Int8, _>(letter.deliveries)
    .bind::<Int8, _>(letter.stream_sequence)
    .execute(conn)
    .await?;
    Ok(())
}

/// Records that the consumer applied an event over a gap in its aggregate's sequence.
async fn insert_gap(
    conn: &mut AsyncPgConnection,
    key: MessageKey<'_>,
    place: Place<'_>,
    after_seq: i64,
    reason: &str,
) -> QueryResult<()> {
    diesel::sql_query(
        "INSERT INTO outbox_inbox_gaps (consumer, source, aggregate_type, aggregate_id, \
             after_seq, next_seq, stream_sequence, reason) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
    )
    .bind::<Text, _>(key.consumer)
    .bind::<Text, _>(key.source)
    .bind::<Text, _>(place.aggregate_type)
    .bind::<Text, _>(place.aggregate_id)
    .bind::<Int8, _>(after_seq)
    .bind::<Int8, _>(place.seq)
    .bind::<Int8, _>(place.stream_sequence)
    .bind::<Text, _>(reason)
    .execute(conn)
    .await?;
    Ok(())
}

/// Whether the consumer settled a message (applied, skipped or dead-lettered it): by its
/// `source` and `message_id`, or, for one it could not read, by its stream sequence.
async fn settled(
    conn: &mut AsyncPgConnection,
    consumer: &str,
    source: &str,
    message_id: Option<&str>,
    stream_sequence: u64,
) -> QueryResult<bool> {
    #[derive(QueryableByName)]
    struct Settled {
        #[diesel(sql_type = Bool)]
        settled: bool,
    }
    let row: Settled = diesel::sql_query(
        "SELECT EXISTS (SELECT 1 FROM outbox_inbox WHERE consumer = $1 \
             AND ((source = $2 AND message_id = $3) OR (source = '' AND message_id = $4))) \
         AS settled",
    )
    .bind::<Text, _>(consumer)
    .bind::<Text, _>(source)
    .bind::<Nullable<Text>, _>(message_id)
    .bind::<Text, _>(unread_id(stream_sequence))
    .get_result(conn)
    .await?;
    Ok(row.settled)
}

/// The consumer's position (last applied sequence) in each of `aggregates` that has one.
async fn positions(
    conn: &mut AsyncPgConnection,
    consumer: &str,
    aggregates: &[Aggregate],
) -> QueryResult<Vec<(Aggregate, i64)>> {
    let column = |field: fn(&Aggregate) -> &String| -> Vec<&str> {
        aggregates.iter().map(|a| field(a).as_str()).collect()
    };
    let rows: Vec<PositionRow> = diesel::sql_query(
        "SELECT p.source, p.aggregate_type, p.aggregate_id, p.last_seq \
         FROM unnest($2::text[], $3::text[], $4::text[]) AS w(source, aggregate_type, aggregate_id) \
         JOIN outbox_inbox_positions p ON p.consumer = $1 AND p.source = w.source \
           AND p.aggregate_type = w.aggregate_type AND p.aggregate_id = w.aggregate_id",
    )
    .bind::<Text, _>(consumer)
    .bind::<Array<Text>, _>(column(|a| &a.source))
    .bind::<Array<Text>, _>(column(|a| &a.aggregate_type))
    .bind::<Array<Text>, _>(column(|a| &a.aggregate_id))
    .load(conn)
    .await?;
    Ok(rows.into_iter().map(PositionRow::into_position).collect())
}

/// Deletes up to `limit` of `consumer`'s inbox rows handled more than `older_than_ms` ago,
/// oldest first, and failed attempts as old; returns how many inbox rows.
async fn purge(
    conn: &mut AsyncPgConnection,
    consumer: &str,
    older_than_ms: i64,
    limit: i64,
) -> QueryResult<usize> {
    diesel::sql_query(
        "WITH attempts AS ( \
             DELETE FROM outbox_inbox_attempts WHERE (consumer, source, message_id) IN ( \
                 SELECT consumer, source, message_id FROM outbox_inbox_attempts \
                 WHERE consumer = $1 AND failed_at < now() - $2 * interval '1 millisecond' \
                 LIMIT $3)) \
         DELETE FROM outbox_inbox WHERE (consumer, source, message_id) IN ( \
             SELECT consumer, source, message_id FROM outbox_inbox \
             WHERE consumer = $1 AND handled_at < now() - $2 * interval '1 millisecond' \
             ORDER BY handled_at LIMIT $3)",
    )
    .bind::<Text, _>(consumer)
    .bind::<Int8, _>(older_than_ms)
    .bind::<Int8, _>(limit)
    .execute(conn)
    .await
}

/// The consumers with rows in `outbox_inbox` (see [`super::consumers`]).
async fn consumers(conn: &mut AsyncPgConnection) -> QueryResult<Vec<String>> {
    let rows: Vec<ConsumerRow> = diesel::sql_query(
        "WITH RECURSIVE c AS ( \
             (SELECT consumer FROM outbox_inbox ORDER BY consumer LIMIT 1) \
             UNION ALL \
             SELECT (SELECT i.consumer FROM outbox_inbox i WHERE i.consumer > c.consumer \
                     ORDER BY i.consumer LIMIT 1) \
             FROM c WHERE c.consumer IS NOT NULL) \
         SELECT consumer::text AS consumer FROM c WHERE consumer IS NOT NULL",
    )
    .load(conn)
    .await?;
    Ok(rows.into_iter().map(|row| row.consumer).collect())
}

#[allow(private_interfaces)]
impl InboxStore for AsyncPgConnection {
    super::store::deadpool_store!(AsyncPgConnection);

    const KIND: Kind = Kind::Postgres;

    async fn connect(database_url: &str, session: &Session) -> Result<Self, ConnectError> {
        database::connect(
            database_url,
            session.connector.as_ref(),
            "outbox-inbox",
            session.limits,
            database::Isolation::Default,
            Some(session.idle_in_transaction),
        )
        .await
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
        finish(self, key, clear_attempts)
            .await
            .map_err(UnitOfWorkError::from_database)
    }

    async fn count_failure(&mut self, key: MessageKey<'_>, error: &str) -> QueryResult<u32> {
        count_failure(self, key, error).await
    }

    async fn insert_dead_letter(&mut self, letter: &DeadLetter<'_>) -> QueryResult<()> {
        insert_dead_letter(self, letter).await
    }

    async fn dead_letter_alone(&mut self, letter: &DeadLetter<'_>) -> QueryResult<()> {
        use diesel_async::AsyncConnection;
        self.transaction::<_, diesel::result::Error, _>(async |conn| {
            record(conn, letter.key, None, false).await?;
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
        insert_gap(self, key, place, after_seq, reason).await
    }

    async fn settled(
        &mut self,
        consumer: &str,
        source: &str,
        message_id: Option<&str>,
        stream_sequence: u64,
    ) -> QueryResult<bool> {
        settled(self, consumer, source, message_id, stream_sequence).await
    }

    async fn positions(
        &mut self,
        consumer: &str,
        aggregates: &[Aggregate],
    ) -> QueryResult<Vec<(Aggregate, i64)>> {
        positions(self, consumer, aggregates).await
    }

    async fn purge(
        &mut self,
        consumer: &str,
        older_than: std::time::Duration,
        limit: i64,
    ) -> QueryResult<usize> {
        let older_than_ms = crate::outbox::purge::age_millis(older_than);
        purge(self, consumer, older_than_ms, limit).await
    }

    async fn consumers(&mut self) -> QueryResult<Vec<String>> {
        consumers(self).await
    }

    async fn lacking_privileges(&mut self) -> QueryResult<Option<String>> {
        use crate::privileges::{Component, PrivilegedConnection};
        self.lacking_for(Component::InboxConsumer).await
    }

    async fn has_positions(&mut self, consumer: &str) -> QueryResult<bool> {
        #[derive(QueryableByName)]
        struct Found {
            #[diesel(sql_type = Bool)]
            found: bool,
        }
        let row: Found = diesel::sql_query(
            "SELECT EXISTS (SELECT 1 FROM outbox_inbox_positions WHERE consumer = $1) AS found",
        )
        .bind::<Text, _>(consumer)
        .get_result(self)
        .await?;
        Ok(row.found)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use diesel::query_builder::QueryFragment;

    fn rendered(statement: &impl QueryFragment<diesel::pg::Pg>) -> String {
        let mut builder = diesel::pg::PgQueryBuilder::default();
        statement.to_sql(&mut builder, &diesel::pg::Pg).unwrap();
        diesel::query_builder::QueryBuilder::finish(builder)
    }

    #[test]
    fn the_statements_render_their_sql() {
        let record = RecordMessage {
            consumer: "c",
            source: "s",
            message_id: "m",
            aggregate_type: None,
            aggregate_id: None,
            seq: None,
            stream_sequence: None,
            accept_gap: false,
        };
        assert_eq!(rendered(&record), RecordMessage::SQL);
        let finish = Finish {
            consumer: "c",
            source: "s",
            message_id: "m",
            clear_attempts: true,
        };
        assert_eq!(rendered(&finish), Finish::SQL);
        let failure = CountFailure {
            consumer: "c",
            source: "s",
            message_id: "m",
            error: "e",
        };
        assert_eq!(rendered(&failure), CountFailure::SQL);
    }
}
