//! A run loop in a tokio task of its own, as [`RelayHandle`](crate::relay::RelayHandle) and
//! `InboxHandle` hold it: the signal that stops it gracefully, and its outcome.

use std::future::Future;

use tokio::task::{JoinError, JoinHandle};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

pub(crate) struct Spawned<E> {
    shutdown: CancellationToken,
    /// `None` once [`stopped`](Self::stopped) has returned the outcome.
    task: Option<JoinHandle<Result<(), E>>>,
}

impl<E: From<JoinError> + Send + 'static> Spawned<E> {
    /// Spawns `run`, given the future that completes when [`shutdown`](Self::shutdown) is
    /// called.
    #[cfg_attr(
        not(any(feature = "postgres", feature = "mysql", feature = "sqlite")),
        allow(dead_code)
    )]
    pub(crate) fn new<F>(run: impl FnOnce(WaitForCancellationFutureOwned) -> F) -> Self
    where
        F: Future<Output = Result<(), E>> + Send + 'static,
    {
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(run(shutdown.clone().cancelled_owned()));
        Self {
            shutdown,
            task: Some(task),
        }
    }

    /// Signals the run to stop and waits for its outcome; `Ok(())` when
    /// [`stopped`](Self::stopped) has returned it already.
    pub(crate) async fn shutdown(self) -> Result<(), E> {
        self.shutdown.cancel();
        match self.task {
            Some(task) => task.await?,
            None => Ok(()),
        }
    }

    /// Waits until the run ends without being asked to, and returns its outcome (its panic
    /// as `E`); cancel-safe; `Ok(())` at once after it has returned.
    pub(crate) async fn stopped(&mut self) -> Result<(), E> {
        let Some(task) = self.task.as_mut() else {
            return Ok(());
        };
        let outcome = task.await;
        self.task = None;
        outcome?
    }
}
