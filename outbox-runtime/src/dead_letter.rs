//! Dead letters: rows the broker rejected `max_attempts` times, and what an operator does
//! with them.
//!
//! A rejection (no stream for the subject, a message over the server's `max_payload`, a
//! stream limit, invalid headers in the row) counts an attempt and is retried with an
//! exponential delay; transport failures (broker down, no ack in time) never count. At
//! `max_attempts` the row becomes a dead letter: it stays in `outbox_events` with
//! `dead_lettered_at` and `last_error` set.
//!
//! By default a dead letter is *sequenced*: the later rows of its aggregate wait behind it,
//! so the aggregate's order is never broken, while other aggregates keep flowing. An operator
//! then [`retry`]s it (after fixing the stream, say) or [`skip`]s it, and the aggregate's
//! queue moves on. The alternative policy,
//! [`DeadLetterPolicy::Skip`](crate::relay::DeadLetterPolicy::Skip), skips a dead letter at
//! once: later rows flow, and the aggregate's consumers see a gap in `ce-sequence`.
//!
//! A skipped dead letter is not lost: it stays in the table, [`list`] shows it (with
//! `skipped_at`), and [`retry`] publishes it. It then arrives after the later events of its
//! aggregate: an [inbox](crate::inbox) consumer that already applied those records it as a
//! dead letter of its own (out of order) rather than applying it out of order.
//!
//! The same operations in SQL, for a psql session, are in each function's documentation.

use diesel::sql_types::{Int4, Int8, Nullable, Text, Timestamptz, Uuid as SqlUuid};
use diesel::{QueryResult, QueryableByName};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use uuid::Uuid;

/// A dead letter, as [`list`] returns it.
#[derive(Clone, Debug, PartialEq, QueryableByName)]
pub struct DeadLetter {
    /// The row id (`ce-id`).
    #[diesel(sql_type = SqlUuid)]
    pub id: Uuid,
    /// The aggregate type.
    #[diesel(sql_type = Text)]
    pub aggregate_type: String,
    /// The aggregate id.
    #[diesel(sql_type = Text)]
    pub aggregate_id: String,
    /// The row's sequence in its aggregate.
    #[diesel(sql_type = Int8)]
    pub aggregate_seq: i64,
    /// The event type.
    #[diesel(sql_type = Text)]
    pub event_type: String,
    /// The subject it was published to.
    #[diesel(sql_type = Text)]
    pub subject: String,
    /// The attempts the broker rejected.
    #[diesel(sql_type = Int4)]
    pub attempts: i32,
    /// The last rejection, as the relay recorded it.
    #[diesel(sql_type = Nullable<Text>)]
    pub last_error: Option<String>,
    /// When the row became a dead letter.
    #[diesel(sql_type = Timestamptz)]
    pub dead_lettered_at: time::OffsetDateTime,
    /// When it was skipped (by the Skip policy or by [`skip`]); `None` while it blocks its
    /// aggregate.
    #[diesel(sql_type = Nullable<Timestamptz>)]
    pub skipped_at: Option<time::OffsetDateTime>,
    /// How many later rows of the aggregate wait behind it (0 for a skipped one).
    #[diesel(sql_type = Int8)]
    pub waiting: i64,
}

/// The dead letters not published, oldest first, at most `limit`: those that block their
/// aggregate and those skipped, which [`retry`] can still publish.
///
/// # Errors
/// The database's error.
pub async fn list(conn: &mut AsyncPgConnection, limit: i64) -> QueryResult<Vec<DeadLetter>> {
    diesel::sql_query(
        "SELECT d.id, d.aggregate_type, d.aggregate_id, d.aggregate_seq, d.event_type, \
                d.subject, d.attempts, d.last_error, d.dead_lettered_at, d.skipped_at, \
                CASE WHEN d.skipped_at IS NOT NULL THEN 0 ELSE (SELECT count(*) FROM outbox_events w \
                 WHERE w.aggregate_type = d.aggregate_type AND w.aggregate_id = d.aggregate_id \
                   AND w.aggregate_seq > d.aggregate_seq \
                   AND w.published_at IS NULL AND w.skipped_at IS NULL) END AS waiting \
         FROM outbox_events d \
         WHERE d.dead_lettered_at IS NOT NULL AND d.published_at IS NULL \
         ORDER BY d.dead_lettered_at \
         LIMIT $1",
    )
    .bind::<Int8, _>(limit)
    .load(conn)
    .await
}

/// A dead letter whole, as [`show`] returns it: the [`DeadLetter`] fields and the message it
/// would be.
#[derive(Clone, Debug, PartialEq, QueryableByName)]
pub struct DeadLetterDetail {
    /// What [`list`] shows of it.
    #[diesel(embed)]
    pub letter: DeadLetter,
    /// The event version.
    #[diesel(sql_type = Int4)]
    pub event_version: i32,
    /// The partition key.
    #[diesel(sql_type = Text)]
    pub partition_key: String,
    /// The payload, as `jsonb` renders it.
    #[diesel(sql_type = Text)]
    pub payload: String,
    /// The row's extra headers (a JSON object).
    #[diesel(sql_type = Text)]
    pub headers: String,
    /// When the event occurred.
    #[diesel(sql_type = Timestamptz)]
    pub occurred_at: time::OffsetDateTime,
    /// Its correlation id, when it has one.
    #[diesel(sql_type = Nullable<Text>)]
    pub correlation_id: Option<String>,
}

/// The dead letter `id`, whole; `None` when `id` is not an unpublished dead letter.
///
/// # Errors
/// The database's error.
pub async fn show(conn: &mut AsyncPgConnection, id: Uuid) -> QueryResult<Option<DeadLetterDetail>> {
    use diesel::OptionalExtension;
    diesel::sql_query(
        "SELECT d.id, d.aggregate_type, d.aggregate_id, d.aggregate_seq, d.event_type, \
                d.subject, d.attempts, d.last_error, d.dead_lettered_at, d.skipped_at, \
                CASE WHEN d.skipped_at IS NOT NULL THEN 0 ELSE (SELECT count(*) FROM outbox_events w \
                 WHERE w.aggregate_type = d.aggregate_type AND w.aggregate_id = d.aggregate_id \
                   AND w.aggregate_seq > d.aggregate_seq \
                   AND w.published_at IS NULL AND w.skipped_at IS NULL) END AS waiting, \
                d.event_version, d.partition_key, d.payload::text AS payload, \
                d.headers::text AS headers, d.occurred_at, d.correlation_id \
         FROM outbox_events d \
         WHERE d.id = $1 AND d.dead_lettered_at IS NOT NULL AND d.published_at IS NULL",
    )
    .bind::<SqlUuid, _>(id)
    .get_result(conn)
    .await
    .optional()
}

/// Retries every unpublished dead letter (skipped ones included), or those of one
/// aggregate type, as [`retry`] does one; returns the ids retried, oldest dead letter first.
///
/// # Errors
/// The database's error; the dead letters retried before it stay retried.
pub async fn retry_all(
    conn: &mut AsyncPgConnection,
    aggregate_type: Option<&str>,
) -> QueryResult<Vec<Uuid>> {
    #[derive(QueryableByName)]
    struct Id {
        #[diesel(sql_type = SqlUuid)]
        id: Uuid,
    }
    let ids: Vec<Id> = diesel::sql_query(
        "SELECT id FROM outbox_events \
         WHERE dead_lettered_at IS NOT NULL AND published_at IS NULL \
           AND ($1::text IS NULL OR aggregate_type = $1) \
         ORDER BY dead_lettered_at, id",
    )
    .bind::<Nullable<Text>, _>(aggregate_type)
    .load(conn)
    .await?;
    let mut retried = Vec::with_capacity(ids.len());
    for Id { id } in ids {
        if retry(conn, id).await? {
            retried.push(id);
        }
    }
    Ok(retried)
}

/// Puts the dead letter `id` back in the queue with its attempts reset, releases the rows
/// waiting behind it, and wakes the relays. Returns whether `id` was an unpublished dead
/// letter. A skipped one is retried too: it is published after the later events of its
/// aggregate, which went out while it was skipped.
///
/// In SQL: `UPDATE outbox_events SET dead_lettered_at = NULL, skipped_at = NULL, attempts =
/// 0, available_at = now() WHERE id = ..`, then `available_at = now()` for the aggregate's
/// later queued rows, `blocked_until = NULL` in `outbox_aggregates`, and `NOTIFY
/// outbox_events`.
///
/// # Errors
/// The database's error.
pub async fn retry(conn: &mut AsyncPgConnection, id: Uuid) -> QueryResult<bool> {
    release(
        conn,
        id,
        "dead_lettered_at = NULL, skipped_at = NULL, attempts = 0, available_at = now()",
        "",
    )
    .await
}

/// Drops the dead letter `id` from the queue for good (it stays in the table with
/// `skipped_at` set, never published), releases the rows waiting behind it, and wakes the
/// relays. Their consumers see a gap in the aggregate's `ce-sequence`. Returns whether `id`
/// was a dead letter.
///
/// In SQL: `UPDATE outbox_events SET skipped_at = now() WHERE id = ..`, then as [`retry`].
///
/// # Errors
/// The database's error.
pub async fn skip(conn: &mut AsyncPgConnection, id: Uuid) -> QueryResult<bool> {
    release(conn, id, "skipped_at = now()", "AND skipped_at IS NULL").await
}

/// Updates the dead letter `id` with `set` (when it also matches `only`), then releases the
/// rows behind it and wakes the relays.
async fn release(
    conn: &mut AsyncPgConnection,
    id: Uuid,
    set: &'static str,
    only: &'static str,
) -> QueryResult<bool> {
    #[derive(QueryableByName)]
    struct Released {
        #[diesel(sql_type = Int8)]
        count: i64,
    }
    let sql = format!(
        "WITH released AS ( \
            UPDATE outbox_events SET {set} \
            WHERE id = $1 AND dead_lettered_at IS NOT NULL AND published_at IS NULL {only} \
            RETURNING aggregate_type, aggregate_id, aggregate_seq \
        ), unparked AS ( \
            UPDATE outbox_events f SET available_at = now() FROM released r \
            WHERE f.aggregate_type = r.aggregate_type AND f.aggregate_id = r.aggregate_id \
              AND f.aggregate_seq > r.aggregate_seq \
              AND f.published_at IS NULL AND f.skipped_at IS NULL AND f.available_at > now() \
        ), unblocked AS ( \
            UPDATE outbox_aggregates a SET blocked_until = NULL FROM released r \
            WHERE a.aggregate_type = r.aggregate_type AND a.aggregate_id = r.aggregate_id \
        ) \
        SELECT (SELECT count(*) FROM released) AS count \
        FROM (SELECT pg_notify('outbox_events', '')) AS woken"
    );
    let released: Released = diesel::sql_query(sql)
        .bind::<SqlUuid, _>(id)
        .get_result(conn)
        .await?;
    Ok(released.count == 1)
}
