//! The relay's wake-up: a dedicated connection that `LISTEN`s on `outbox_events`.
//!
//! The outbox's insert trigger calls `pg_notify('outbox_events', '')`; PostgreSQL delivers
//! the notification when the inserting transaction commits and drops it when it rolls back
//! (PostgreSQL docs, NOTIFY), so a notification means committed rows. Each one wakes every
//! worker; a worker woken while busy keeps the wake-up for its next wait, so none is lost
//! between a notification and the worker's next claim.
//!
//! Notifications are an accelerator, not the mechanism: when the connection drops the
//! listener reconnects with backoff and, once listening again, wakes the workers (rows may
//! have committed while nobody listened). Meanwhile the workers poll.

use std::sync::Arc;

use diesel_async::RunQueryDsl;
use futures::StreamExt;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::{Backoff, Shared};

/// The channel the outbox's insert trigger notifies.
pub(crate) const CHANNEL: &str = "outbox_events";

pub(super) async fn run(shared: &Shared, wakers: Vec<Arc<Notify>>, stop: CancellationToken) {
    let wake_all = || wakers.iter().for_each(|wake| wake.notify_one());
    let mut backoff = Backoff::new(shared.config.max_backoff);
    while !stop.is_cancelled() {
        match listen(shared).await {
            Ok(mut conn) => {
                backoff.reset();
                wake_all();
                let mut notifications = std::pin::pin!(conn.notifications_stream());
                loop {
                    tokio::select! {
                        biased;
                        () = stop.cancelled() => return,
                        notification = notifications.next() => match notification {
                            Some(Ok(_)) => {
                                metrics::counter!("outbox_relay_notifications_total").increment(1);
                                wake_all();
                            }
                            Some(Err(error)) => {
                                tracing::warn!(%error, "the relay's LISTEN connection failed; polling until it is back");
                                break;
                            }
                            None => {
                                tracing::warn!("the relay's LISTEN connection closed; polling until it is back");
                                break;
                            }
                        },
                    }
                }
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

async fn listen(shared: &Shared) -> Result<diesel_async::AsyncPgConnection, String> {
    let mut conn = super::worker::connect(shared)
        .await
        .map_err(|e| e.to_string())?;
    let listening = diesel::sql_query(format!("LISTEN {CHANNEL}")).execute(&mut conn);
    tokio::time::timeout(shared.config.statement_timeout, listening)
        .await
        .map_err(|_| {
            format!(
                "LISTEN did not answer within {:?}",
                shared.config.statement_timeout
            )
        })?
        .map_err(|e| e.to_string())?;
    Ok(conn)
}
