//! The inbox's statements.

use diesel::QueryResult;
use diesel::sql_types::{Bytea, Int8, Jsonb, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl};

use crate::outbox::statement::statement;

statement! {
    /// Records a message as handled by a consumer, unless it already was.
    struct RecordHandled<'a> {
        consumer: &'a str => Text,
        message_id: &'a str => Text,
    }
    sql = "INSERT INTO outbox_inbox (consumer, message_id) VALUES ($1, $2) ON CONFLICT DO NOTHING";
}

/// Records the message `message_id` as handled by `consumer`; `false` when it already was.
///
/// Guarantee: run in the transaction that handles the message, the primary key on
/// `(consumer, message_id)` lets one transaction only record it. A concurrent second
/// delivery waits on the first transaction's insert and then finds the row.
pub(crate) async fn record_handled(
    conn: &mut AsyncPgConnection,
    consumer: &str,
    message_id: &str,
) -> QueryResult<bool> {
    let inserted = RecordHandled {
        consumer,
        message_id,
    }
    .execute(conn)
    .await?;
    Ok(inserted == 1)
}

/// A message to dead-letter, whole.
pub(crate) struct DeadLetter<'a> {
    pub consumer: &'a str,
    pub message_id: &'a str,
    pub subject: &'a str,
    pub headers: &'a serde_json::Value,
    pub payload: &'a [u8],
    pub error: &'a str,
    pub deliveries: i64,
    pub stream_sequence: i64,
}

/// Records a dead letter, and the message as handled so that a later delivery of it is
/// skipped, in one statement.
pub(crate) async fn record_dead_letter(
    conn: &mut AsyncPgConnection,
    letter: &DeadLetter<'_>,
) -> QueryResult<()> {
    diesel::sql_query(
        "WITH letter AS ( \
             INSERT INTO outbox_inbox_dead_letters (consumer, message_id, subject, headers, \
                 payload, error, deliveries, stream_sequence) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT DO NOTHING) \
         INSERT INTO outbox_inbox (consumer, message_id) VALUES ($1, $2) ON CONFLICT DO NOTHING",
    )
    .bind::<Text, _>(letter.consumer)
    .bind::<Text, _>(letter.message_id)
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

/// Deletes up to `limit` of `consumer`'s inbox rows handled more than `older_than_ms` ago,
/// oldest first; returns how many.
pub(crate) async fn purge(
    conn: &mut AsyncPgConnection,
    consumer: &str,
    older_than_ms: i64,
    limit: i64,
) -> QueryResult<usize> {
    diesel::sql_query(
        "DELETE FROM outbox_inbox WHERE (consumer, message_id) IN ( \
             SELECT consumer, message_id FROM outbox_inbox \
             WHERE consumer = $1 AND handled_at < now() - $2 * interval '1 millisecond' \
             ORDER BY handled_at LIMIT $3)",
    )
    .bind::<Text, _>(consumer)
    .bind::<Int8, _>(older_than_ms)
    .bind::<Int8, _>(limit)
    .execute(conn)
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use diesel::query_builder::QueryFragment;

    #[test]
    fn record_handled_renders_its_sql() {
        let mut builder = diesel::pg::PgQueryBuilder::default();
        let statement = RecordHandled {
            consumer: "c",
            message_id: "m",
        };
        statement.to_sql(&mut builder, &diesel::pg::Pg).unwrap();
        assert_eq!(
            diesel::query_builder::QueryBuilder::finish(builder),
            RecordHandled::SQL
        );
    }
}
