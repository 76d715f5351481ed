//! Each database's statements for [`purge_published`](super::purge_published) and
//! [`purge_dedup_keys`](super::purge_dedup_keys), and MySQL's and SQLite's for their archive
//! (`crate::mysql::purge_archived`, `crate::sqlite::purge_archived`).

use std::future::Future;
use std::time::Duration;

use diesel::QueryResult;

/// `older_than` in whole milliseconds, at most [`LONGEST_AGE`]'s.
pub(crate) fn age_millis(older_than: Duration) -> i64 {
    i64::try_from(older_than.min(LONGEST_AGE).as_millis()).unwrap_or(i64::MAX)
}

/// The oldest a purge looks: a thousand years of 365.25 days. No row is older, and so a
/// longer `older_than` (`Duration::MAX`, to keep everything) purges what this one does,
/// nothing, where PostgreSQL would fail the statement: `now() - ms * interval '1
/// millisecond'` is out of its interval's range from about 178 million years (PostgreSQL
/// docs, "Date/Time Types"), and out of `timestamptz`'s before 4713 BC.
const LONGEST_AGE: Duration = Duration::from_secs(1_000 * 31_557_600);

// The module is crate-private in effect: `Purges` cannot be implemented outside the crate.
pub(crate) mod sealed {
    use super::*;

    /// A database's statements for the purges.
    pub trait Purges {
        /// Deletes the rows published more than `older_than` ago, `batch` per statement,
        /// telling `progress` the running total after each; how many.
        fn purge_published(
            &mut self,
            older_than: Duration,
            batch: i64,
            progress: &mut (dyn FnMut(usize) + Send),
        ) -> impl Future<Output = QueryResult<usize>> + Send;

        /// Deletes the dedup keys taken more than `older_than` ago, `batch` per statement;
        /// how many.
        fn purge_dedup_keys(
            &mut self,
            older_than: Duration,
            batch: i64,
        ) -> impl Future<Output = QueryResult<usize>> + Send;
    }
}

/// The running total of a purge in batches of `batch` rows.
struct Batches {
    batch: i64,
    deleted: usize,
}

impl Batches {
    fn of(batch: i64) -> Self {
        Self { batch, deleted: 0 }
    }

    /// Counts a batch that deleted `gone` rows and tells `progress` the total; whether the
    /// purge is done (the batch was not full).
    fn done(&mut self, gone: usize, progress: &mut (dyn FnMut(usize) + Send)) -> bool {
        self.deleted += gone;
        progress(self.deleted);
        i64::try_from(gone).unwrap_or(i64::MAX) < self.batch
    }
}

#[cfg(feature = "postgres")]
mod postgres {
    use diesel::sql_types::{Int8, Nullable, Timestamptz};
    use diesel::{QueryResult, QueryableByName};
    use diesel_async::{AsyncPgConnection, RunQueryDsl};
    use std::time::Duration;
    use time::OffsetDateTime;

    use super::{Batches, age_millis};

    impl super::sealed::Purges for AsyncPgConnection {
        /// Through the partial index of published rows on `published_at`, oldest first, each
        /// batch starting where the previous one ended: a purge reads only the rows it
        /// deletes (neither the queue nor the kept rows, nor, batch after batch, the index
        /// entries of rows already deleted).
        async fn purge_published(
            &mut self,
            older_than: Duration,
            batch: i64,
            progress: &mut (dyn FnMut(usize) + Send),
        ) -> QueryResult<usize> {
            #[derive(QueryableByName)]
            struct Cutoff {
                #[diesel(sql_type = Timestamptz)]
                cutoff: OffsetDateTime,
            }
            #[derive(QueryableByName)]
            struct Gone {
                #[diesel(sql_type = Int8)]
                deleted: i64,
                #[diesel(sql_type = Nullable<Timestamptz>)]
                last: Option<OffsetDateTime>,
            }
            let Cutoff { cutoff } =
                diesel::sql_query("SELECT now() - $1 * interval '1 millisecond' AS cutoff")
                    .bind::<Int8, _>(age_millis(older_than))
                    .get_result(self)
                    .await?;
            let (mut batches, mut from) = (Batches::of(batch), None);
            loop {
                // `>=` the last batch's newest: rows published in the same instant may be left.
                let gone: Gone = diesel::sql_query(
                    "WITH gone AS ( \
                         DELETE FROM outbox_events WHERE id IN ( \
                             SELECT id FROM outbox_events \
                             WHERE published_at >= coalesce($1, '-infinity') AND published_at < $2 \
                             ORDER BY published_at LIMIT $3) \
                         RETURNING published_at) \
                     SELECT count(*)::int8 AS deleted, max(published_at) AS last FROM gone",
                )
                .bind::<Nullable<Timestamptz>, _>(from)
                .bind::<Timestamptz, _>(cutoff)
                .bind::<Int8, _>(batch)
                .get_result(self)
                .await?;
                if batches.done(usize::try_from(gone.deleted).unwrap_or(0), progress) {
                    return Ok(batches.deleted);
                }
                from = gone.last;
            }
        }

        async fn purge_dedup_keys(
            &mut self,
            older_than: Duration,
            batch: i64,
        ) -> QueryResult<usize> {
            let (older_than_ms, mut batches) = (age_millis(older_than), Batches::of(batch));
            loop {
                let gone = diesel::sql_query(
                    "DELETE FROM outbox_dedup_keys WHERE dedup_key IN ( \
                         SELECT dedup_key FROM outbox_dedup_keys \
                         WHERE created_at < now() - $1 * interval '1 millisecond' \
                         ORDER BY created_at LIMIT $2)",
                )
                .bind::<Int8, _>(older_than_ms)
                .bind::<Int8, _>(batch)
                .execute(self)
                .await?;
                if batches.done(gone, &mut |_| {}) {
                    return Ok(batches.deleted);
                }
            }
        }
    }
}

#[cfg(feature = "mysql")]
pub(crate) mod mysql {
    use diesel::mysql::Mysql;
    use diesel::sql_types::{BigInt, Text};
    use diesel::{QueryResult, QueryableByName};
    use diesel_async::{AsyncMysqlConnection, RunQueryDsl};
    use std::time::Duration;

    use super::{Batches, age_millis};

    /// `older_than` before the server's clock, as DATETIME(6) text.
    async fn cutoff(conn: &mut AsyncMysqlConnection, older_than: Duration) -> QueryResult<String> {
        #[derive(QueryableByName)]
        struct Cutoff {
            #[diesel(sql_type = Text)]
            cutoff: String,
        }
        let Cutoff { cutoff } = diesel::sql_query(
            // Out of DATETIME's range (before year 1000), the subtraction is NULL.
            "SELECT CAST(COALESCE(UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND, \
                                  '1000-01-01 00:00:00') AS CHAR) AS cutoff",
        )
        .bind::<BigInt, _>(age_millis(older_than).saturating_mul(1_000))
        .get_result(conn)
        .await?;
        Ok(cutoff)
    }

    /// Runs `statement` in batches until one deletes fewer than `batch` rows: each of its
    /// placeholders but the last is the cutoff, `older_than` before the server's clock, and
    /// the last is `batch`.
    async fn purge(
        conn: &mut AsyncMysqlConnection,
        statement: &'static str,
        older_than: Duration,
        batch: i64,
        progress: &mut (dyn FnMut(usize) + Send),
    ) -> QueryResult<usize> {
        let (cutoff, mut batches) = (cutoff(conn, older_than).await?, Batches::of(batch));
        let cutoffs = statement.matches('?').count().saturating_sub(1);
        loop {
            let mut query = diesel::sql_query(statement).into_boxed::<Mysql>();
            for _ in 0..cutoffs {
                query = query.bind::<Text, _>(cutoff.clone());
            }
            let gone = query.bind::<BigInt, _>(batch).execute(conn).await?;
            if batches.done(gone, progress) {
                return Ok(batches.deleted);
            }
        }
    }

    /// [`crate::mysql::purge_archived`]: through the archive's primary key, which starts
    /// with `published_at`, oldest first: each batch reads only the rows it deletes.
    pub(crate) async fn purge_archived(
        conn: &mut AsyncMysqlConnection,
        older_than: Duration,
        batch: i64,
        progress: &mut (dyn FnMut(usize) + Send),
    ) -> QueryResult<usize> {
        purge(
            conn,
            "DELETE FROM outbox_published WHERE published_at < ? \
             ORDER BY published_at, id LIMIT ?",
            older_than,
            batch,
            progress,
        )
        .await
    }

    impl super::sealed::Purges for AsyncMysqlConnection {
        /// Through the claim's index on `(available_at, id)`: a row the relay marked
        /// published became available before it was published, so the rows to delete lie
        /// in the index's range before the cutoff, beside the few queued rows and dead
        /// letters that became available before it (MySQL has no partial index to keep a
        /// separate one of published rows only). `DELETE ... ORDER BY ... LIMIT` bounds each
        /// statement.
        async fn purge_published(
            &mut self,
            older_than: Duration,
            batch: i64,
            progress: &mut (dyn FnMut(usize) + Send),
        ) -> QueryResult<usize> {
            purge(
                self,
                "DELETE FROM outbox_events \
                 WHERE available_at < ? AND published_at < ? \
                 ORDER BY available_at, id LIMIT ?",
                older_than,
                batch,
                progress,
            )
            .await
        }

        async fn purge_dedup_keys(
            &mut self,
            older_than: Duration,
            batch: i64,
        ) -> QueryResult<usize> {
            purge(
                self,
                "DELETE FROM outbox_dedup_keys WHERE created_at < ? \
                 ORDER BY created_at LIMIT ?",
                older_than,
                batch,
                &mut |_| {},
            )
            .await
        }
    }
}

#[cfg(feature = "sqlite")]
pub(crate) mod sqlite {
    use diesel::sql_types::{BigInt, Text};
    use diesel::{QueryResult, QueryableByName, RunQueryDsl};
    use std::time::Duration;

    use super::{Batches, age_millis};
    use crate::sqlite::{AsyncSqliteConnection, SqliteConnection};

    /// `older_than` before now, in the tables' time shape (UTC text to the millisecond).
    fn cutoff(conn: &mut SqliteConnection, older_than: Duration) -> QueryResult<String> {
        #[derive(QueryableByName)]
        struct Cutoff {
            #[diesel(sql_type = Text)]
            cutoff: String,
        }
        // A modifier of whole seconds and a fraction (SQLite docs, "Date And Time
        // Functions", modifiers 1-6); out of the calendar, the cutoff is its start.
        let ms = age_millis(older_than);
        let Cutoff { cutoff } = diesel::sql_query(
            "SELECT coalesce(strftime('%Y-%m-%d %H:%M:%f', 'now', ?), '0000-01-01') AS cutoff",
        )
        .bind::<Text, _>(format!("-{}.{:03} seconds", ms / 1_000, ms % 1_000))
        .get_result(conn)?;
        Ok(cutoff)
    }

    /// Runs `statement` (binds: the cutoff, the batch) in batches on the file, each batch in
    /// a `BEGIN IMMEDIATE` transaction of its own that waits for the write lock as units of
    /// work do ([`crate::sqlite::begin_immediate`]).
    async fn purge(
        conn: &mut AsyncSqliteConnection,
        statement: &'static str,
        older_than: Duration,
        batch: i64,
        progress: &mut (dyn FnMut(usize) + Send),
    ) -> QueryResult<usize> {
        let cutoff = conn
            .spawn_blocking(move |conn| cutoff(conn, older_than))
            .await?;
        let mut batches = Batches::of(batch);
        loop {
            let cutoff = cutoff.clone();
            let gone = conn
                .spawn_blocking(move |conn| {
                    crate::sqlite::immediate_transaction(conn, |conn| {
                        diesel::sql_query(statement)
                            .bind::<Text, _>(cutoff)
                            .bind::<BigInt, _>(batch)
                            .execute(conn)
                    })
                })
                .await?;
            if batches.done(gone, progress) {
                return Ok(batches.deleted);
            }
        }
    }

    /// [`crate::sqlite::purge_archived`]: through the archive's index on `published_at`
    /// (`outbox_published_at`), oldest first.
    pub(crate) async fn purge_archived(
        conn: &mut AsyncSqliteConnection,
        older_than: Duration,
        batch: i64,
        progress: &mut (dyn FnMut(usize) + Send),
    ) -> QueryResult<usize> {
        purge(
            conn,
            "DELETE FROM outbox_published WHERE rowid IN ( \
                 SELECT rowid FROM outbox_published WHERE published_at < ? \
                 ORDER BY published_at LIMIT ?)",
            older_than,
            batch,
            progress,
        )
        .await
    }

    impl super::sealed::Purges for AsyncSqliteConnection {
        /// Through the partial index of published rows on `published_at`
        /// (`outbox_events_published`), oldest first.
        async fn purge_published(
            &mut self,
            older_than: Duration,
            batch: i64,
            progress: &mut (dyn FnMut(usize) + Send),
        ) -> QueryResult<usize> {
            purge(
                self,
                "DELETE FROM outbox_events WHERE id IN ( \
                     SELECT id FROM outbox_events \
                     WHERE published_at IS NOT NULL AND published_at < ? \
                     ORDER BY published_at LIMIT ?)",
                older_than,
                batch,
                progress,
            )
            .await
        }

        async fn purge_dedup_keys(
            &mut self,
            older_than: Duration,
            batch: i64,
        ) -> QueryResult<usize> {
            purge(
                self,
                "DELETE FROM outbox_dedup_keys WHERE dedup_key IN ( \
                     SELECT dedup_key FROM outbox_dedup_keys WHERE created_at < ? \
                     ORDER BY created_at LIMIT ?)",
                older_than,
                batch,
                &mut |_| {},
            )
            .await
        }
    }
}
