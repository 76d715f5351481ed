//! Each database's statements for [`queued_by_type`](super::queued_by_type) and
//! [`published_last_minute`](super::published_last_minute).

use std::future::Future;

use diesel::QueryResult;

use super::QueuedByType;

// The module is crate-private in effect: `Reports` cannot be implemented outside the crate.
pub(crate) mod sealed {
    use super::*;

    /// A database's statements for what an operator reads of the outbox.
    pub trait Reports {
        /// The queued rows and dead letters by aggregate type and event type, the most
        /// queued first.
        fn queued_by_type(&mut self)
        -> impl Future<Output = QueryResult<Vec<QueuedByType>>> + Send;

        /// The rows published in the last minute that the tables still hold, counting at
        /// most `window` in each table.
        fn published_last_minute(
            &mut self,
            window: i64,
        ) -> impl Future<Output = QueryResult<i64>> + Send;
    }
}

#[derive(diesel::QueryableByName)]
struct Count {
    #[diesel(sql_type = diesel::sql_types::BigInt)]
    count: i64,
}

#[cfg(feature = "postgres")]
mod postgres {
    use diesel::QueryResult;
    use diesel::sql_types::Int8;
    use diesel_async::{AsyncPgConnection, RunQueryDsl};

    use super::{Count, QueuedByType};

    impl super::sealed::Reports for AsyncPgConnection {
        /// Through the partial index of queued rows.
        async fn queued_by_type(&mut self) -> QueryResult<Vec<QueuedByType>> {
            diesel::sql_query(
                "SELECT aggregate_type::text AS aggregate_type, event_type, \
                        count(*) FILTER (WHERE dead_lettered_at IS NULL) AS queued, \
                        count(*) FILTER (WHERE dead_lettered_at IS NOT NULL) AS dead_letters \
                 FROM outbox_events WHERE published_at IS NULL AND skipped_at IS NULL \
                 GROUP BY 1, 2 ORDER BY 3 DESC, 4 DESC, 1, 2",
            )
            .load(self)
            .await
        }

        /// Marked rows through the partial index of published rows, archived ones through
        /// `outbox_published`'s BRIN index on `published_at`.
        async fn published_last_minute(&mut self, window: i64) -> QueryResult<i64> {
            let row: Count = diesel::sql_query(
                "SELECT (SELECT count(*) FROM ( \
                             SELECT 1 FROM outbox_events \
                             WHERE published_at > now() - interval '1 minute' LIMIT $1) marked) \
                      + (SELECT count(*) FROM ( \
                             SELECT 1 FROM outbox_published \
                             WHERE published_at > now() - interval '1 minute' LIMIT $1) archived) \
                      AS count",
            )
            .bind::<Int8, _>(window)
            .get_result(self)
            .await?;
            Ok(row.count)
        }
    }
}

#[cfg(feature = "mysql")]
mod mysql {
    use diesel::QueryResult;
    use diesel::sql_types::BigInt;
    use diesel_async::{AsyncMysqlConnection, RunQueryDsl};

    use super::{Count, QueuedByType};

    impl super::sealed::Reports for AsyncMysqlConnection {
        /// Reads every row of `outbox_events`, as [`crate::mysql::stats`] does.
        async fn queued_by_type(&mut self) -> QueryResult<Vec<QueuedByType>> {
            diesel::sql_query(
                "SELECT aggregate_type, event_type, \
                        CAST(SUM(dead_lettered_at IS NULL) AS SIGNED) AS queued, \
                        CAST(SUM(dead_lettered_at IS NOT NULL) AS SIGNED) AS dead_letters \
                 FROM outbox_events WHERE published_at IS NULL AND skipped_at IS NULL \
                 GROUP BY aggregate_type, event_type \
                 ORDER BY queued DESC, dead_letters DESC, aggregate_type, event_type",
            )
            .load(self)
            .await
        }

        /// Marked rows and archived ones. No index of `outbox_events` holds
        /// `published_at`, so it reads `outbox_events` until it has counted `window` (every
        /// row when fewer were published in the minute): cheap with
        /// [`crate::PublishedRows::Delete`], the default, and with
        /// [`crate::PublishedRows::Archive`]; with [`crate::PublishedRows::Mark`], as large
        /// as what the purges keep. The archive is read through its primary key, which
        /// starts with `published_at`.
        async fn published_last_minute(&mut self, window: i64) -> QueryResult<i64> {
            let row: Count = diesel::sql_query(
                "SELECT (SELECT COUNT(*) FROM ( \
                             SELECT 1 FROM outbox_events \
                             WHERE published_at > UTC_TIMESTAMP(6) - INTERVAL 1 MINUTE \
                             LIMIT ?) marked) \
                      + (SELECT COUNT(*) FROM ( \
                             SELECT 1 FROM outbox_published \
                             WHERE published_at > UTC_TIMESTAMP(6) - INTERVAL 1 MINUTE \
                             LIMIT ?) archived) AS count",
            )
            .bind::<BigInt, _>(window)
            .bind::<BigInt, _>(window)
            .get_result(self)
            .await?;
            Ok(row.count)
        }
    }
}

#[cfg(feature = "sqlite")]
mod sqlite {
    use diesel::sql_types::BigInt;
    use diesel::{QueryResult, RunQueryDsl};

    use super::{Count, QueuedByType};
    use crate::sqlite::AsyncSqliteConnection;

    impl super::sealed::Reports for AsyncSqliteConnection {
        /// Through the partial index of queued rows; a read, without the write lock.
        async fn queued_by_type(&mut self) -> QueryResult<Vec<QueuedByType>> {
            self.spawn_blocking(|conn| {
                diesel::sql_query(
                    "SELECT aggregate_type, event_type, \
                            SUM(dead_lettered_at IS NULL) AS queued, \
                            SUM(dead_lettered_at IS NOT NULL) AS dead_letters \
                     FROM outbox_events WHERE published_at IS NULL AND skipped_at IS NULL \
                     GROUP BY aggregate_type, event_type \
                     ORDER BY queued DESC, dead_letters DESC, aggregate_type, event_type",
                )
                .load(conn)
            })
            .await
        }

        /// Marked rows through the partial index of published rows
        /// (`outbox_events_published`), archived ones through the archive's index on
        /// `published_at`.
        async fn published_last_minute(&mut self, window: i64) -> QueryResult<i64> {
            self.spawn_blocking(move |conn| {
                let row: Count = diesel::sql_query(
                    "SELECT (SELECT count(*) FROM ( \
                                 SELECT 1 FROM outbox_events \
                                 WHERE published_at IS NOT NULL \
                                   AND published_at > strftime('%Y-%m-%d %H:%M:%f', 'now', '-60 seconds') \
                                 LIMIT ?) marked) \
                          + (SELECT count(*) FROM ( \
                                 SELECT 1 FROM outbox_published \
                                 WHERE published_at > strftime('%Y-%m-%d %H:%M:%f', 'now', '-60 seconds') \
                                 LIMIT ?) archived) AS count",
                )
                .bind::<BigInt, _>(window)
                .bind::<BigInt, _>(window)
                .get_result(conn)?;
                Ok(row.count)
            })
            .await
        }
    }
}
