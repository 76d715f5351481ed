//! A test kit for services built on the outbox (Cargo feature `testing`).
//!
//! Three levels, from the cheapest:
//!
//! - **Aggregates, without a database**: [`AggregateTest`] states a test as *given* an
//!   aggregate (and the events it had), *when* a command runs, *then* these events were
//!   recorded and nothing else. Events are compared as consumers see them (event type,
//!   version, partition key, dedup key and payload JSON), so events need no `PartialEq`, and
//!   a failure prints both lists side by side.
//! - **Units of work, without a database**: [`InMemoryOutbox`] runs the unit of work's own
//!   checks and numbering (subject tokens, payloads, per-aggregate sequences, dedup keys,
//!   draining the aggregates only when the closure succeeds) and keeps what it would have
//!   written as [`WrittenEvent`]s. Code that only tracks aggregates and emits events takes
//!   `&mut impl CollectEvents` and runs against both the real [`UnitOfWork`](crate::UnitOfWork) and this one.
//! - **End to end** (with the feature `postgres`): [`TestEnv`] is a throwaway PostgreSQL
//!   database (migrated) with a subject prefix and a stream of its own, both removed when it
//!   drops, and
//!   [`TestEnv::wait_for_events`] waits until given events are on the stream. This
//!   project's own end-to-end tests run on it.
//!
//! ```
//! use outbox_runtime::testing::AggregateTest;
//! use outbox_runtime::{DomainEvent, PendingEvents, aggregate};
//! use serde::{Deserialize, Serialize};
//!
//! #[derive(Debug, Serialize, Deserialize, DomainEvent)]
//! enum AccountEvent { Opened { owner: String }, Deposited { cents: i64 } }
//!
//! #[aggregate]
//! struct Account { id: String, balance: i64, pending_events: PendingEvents<AccountEvent> }
//!
//! impl Account {
//!     fn deposit(&mut self, cents: i64) -> Result<(), String> {
//!         if cents <= 0 {
//!             return Err(format!("a deposit of {cents} cents"));
//!         }
//!         self.balance += cents;
//!         self.record(AccountEvent::Deposited { cents });
//!         Ok(())
//!     }
//! }
//!
//! let account = || Account { id: "a-1".into(), balance: 0, pending_events: PendingEvents::new() };
//! AggregateTest::given(account())
//!     .when(|a| a.deposit(250))
//!     .then_ok()
//!     .then_recorded([AccountEvent::Deposited { cents: 250 }]);
//! let error = AggregateTest::given(account()).when(|a| a.deposit(-5)).then_recorded_nothing().then_err();
//! assert_eq!(error, "a deposit of -5 cents");
//! ```

use std::collections::{HashMap, HashSet};
use std::fmt::{self, Debug, Write as _};
use std::sync::Mutex;

use uuid::Uuid;
// What the throwaway PostgreSQL databases and their streams use.
#[cfg(feature = "postgres")]
use {
    crate::publisher::StreamSettings,
    crate::relay::RelayConfig,
    async_nats::jetstream::{
        self,
        consumer::{DeliverPolicy, pull},
    },
    diesel_async::{AsyncConnection, AsyncPgConnection, SimpleAsyncConnection},
    futures::StreamExt,
    std::time::Duration,
};

use crate::aggregate::Aggregate;
use crate::causality::Causality;
use crate::event::{DomainEvent, EventSet, PayloadError};
use crate::outbox::Outbox;
use crate::topology::Topology;
use crate::unit_of_work::{
    CollectEvents, DuplicateEvents, EventBuffer, UnitOfWorkError, drop_duplicates,
};

// ---- Aggregates --------------------------------------------------------------------------

/// An aggregate test: *given* an aggregate, *when* a command runs on it, *then* it recorded
/// these events. See [the module](self) for an example.
pub struct AggregateTest<A: Aggregate> {
    aggregate: A,
}

impl<A: Aggregate> AggregateTest<A> {
    /// Starts from `aggregate` as it is. Events still pending on it are history, not what
    /// the test checks: they are discarded.
    pub fn given(mut aggregate: A) -> Self {
        aggregate.discard_pending_events();
        Self { aggregate }
    }

    /// Starts from `aggregate` after `events` happened, each applied with `apply` (the
    /// aggregate's own fold, for one rebuilt from its events). Whatever `apply` records is
    /// discarded.
    pub fn given_events(
        mut aggregate: A,
        events: impl IntoIterator<Item = A::Event>,
        mut apply: impl FnMut(&mut A, A::Event),
    ) -> Self {
        for event in events {
            apply(&mut aggregate, event);
        }
        Self::given(aggregate)
    }

    /// Runs `command` on the aggregate and takes the events it recorded.
    pub fn when<R>(mut self, command: impl FnOnce(&mut A) -> R) -> Then<A, R> {
        let result = command(&mut self.aggregate);
        let recorded = self.aggregate.discard_pending_events();
        Then {
            aggregate: self.aggregate,
            result,
            recorded,
        }
    }
}

/// What a command did: its result, the events it recorded, and the aggregate after it.
pub struct Then<A: Aggregate, R> {
    aggregate: A,
    result: R,
    recorded: Vec<A::Event>,
}

impl<A: Aggregate, R> Then<A, R> {
    /// Asserts that the command recorded exactly `expected`, in order.
    ///
    /// # Panics
    /// When it did not, with both lists, one event per line
    /// (`type vN partition key, payload`), the first difference marked.
    #[track_caller]
    pub fn then_recorded(self, expected: impl IntoIterator<Item = A::Event>) -> Self {
        let expected: Vec<A::Event> = expected.into_iter().collect();
        let expected: Vec<Wire> = expected.iter().map(Wire::of).collect();
        let recorded: Vec<Wire> = self.recorded.iter().map(Wire::of).collect();
        if expected != recorded {
            panic!(
                "{} {:?} recorded other events than expected:\n{}",
                A::AGGREGATE_TYPE,
                self.aggregate.aggregate_id(),
                side_by_side(&expected, &recorded)
            );
        }
        self
    }

    /// Asserts that the command recorded no event.
    ///
    /// # Panics
    /// When it recorded some, listing them.
    #[track_caller]
    pub fn then_recorded_nothing(self) -> Self {
        self.then_recorded([])
    }

    /// The events the command recorded, oldest first.
    pub fn recorded(&self) -> &[A::Event] {
        &self.recorded
    }

    /// What the command returned.
    pub fn result(&self) -> &R {
        &self.result
    }

    /// The aggregate after the command.
    pub fn aggregate(&self) -> &A {
        &self.aggregate
    }

    /// The aggregate, the command's result and the events it recorded.
    pub fn into_parts(self) -> (A, R, Vec<A::Event>) {
        (self.aggregate, self.result, self.recorded)
    }
}

impl<A: Aggregate, T, E: Debug> Then<A, Result<T, E>> {
    /// Asserts that the command returned `Ok`.
    ///
    /// # Panics
    /// With the error, when it returned one.
    #[track_caller]
    pub fn then_ok(self) -> Self {
        if let Err(error) = &self.result {
            panic!(
                "{} {:?}: the command failed: {error:?}",
                A::AGGREGATE_TYPE,
                self.aggregate.aggregate_id()
            );
        }
        self
    }

    /// Asserts that the command returned `Err`, and returns the error.
    ///
    /// # Panics
    /// When it returned `Ok`, listing what it recorded.
    #[track_caller]
    pub fn then_err(self) -> E {
        match self.result {
            Err(error) => error,
            Ok(_) => panic!(
                "{} {:?}: the command succeeded, recording {} event(s): {:?}",
                A::AGGREGATE_TYPE,
                self.aggregate.aggregate_id(),
                self.recorded.len(),
                self.recorded.iter().map(Wire::of).collect::<Vec<_>>()
            ),
        }
    }
}

/// An event as a consumer sees it.
#[derive(PartialEq)]
struct Wire {
    event_type: &'static str,
    event_version: i32,
    partition_key: Option<String>,
    dedup_key: Option<String>,
    /// The payload as JSON (so map order does not matter), or its error.
    payload: Result<serde_json::Value, String>,
}

impl Wire {
    fn of<E: DomainEvent>(event: &E) -> Self {
        let payload = event
            .to_payload()
            .map_err(|e| e.to_string())
            .and_then(|json| serde_json::from_str(&json).map_err(|e| e.to_string()));
        Self {
            event_type: event.event_type(),
            event_version: event.event_version(),
            partition_key: event.partition_key(),
            dedup_key: event.dedup_key(),
            payload,
        }
    }
}

impl Debug for Wire {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} v{}", self.event_type, self.event_version)?;
        if let Some(key) = &self.partition_key {
            write!(f, " partition key {key:?}")?;
        }
        if let Some(key) = &self.dedup_key {
            write!(f, " dedup key {key:?}")?;
        }
        match &self.payload {
            Ok(json) => write!(f, " {json}"),
            Err(error) => write!(f, " (payload does not serialize: {error})"),
        }
    }
}

fn side_by_side(expected: &[Wire], recorded: &[Wire]) -> String {
    let mut text = String::new();
    for i in 0..expected.len().max(recorded.len()) {
        let (e, r) = (expected.get(i), recorded.get(i));
        let mark = if e == r { ' ' } else { '>' };
        let show = |w: Option<&Wire>| w.map_or_else(|| "(none)".to_owned(), |w| format!("{w:?}"));
        let _ = writeln!(text, "{mark} #{}  expected: {}", i + 1, show(e));
        let _ = writeln!(
            text,
            "{mark} {:w$}  recorded: {}",
            "",
            show(r),
            w = digits(i + 1) + 1
        );
    }
    text
}

fn digits(n: usize) -> usize {
    n.to_string().len()
}

// ---- Units of work -------------------------------------------------------------------------

/// An outbox in memory: units of work run the real one's checks and numbering, and what they
/// would have written is kept, for service tests without PostgreSQL.
///
/// ```
/// use outbox_runtime::testing::InMemoryOutbox;
/// use outbox_runtime::{CollectEvents, DomainEvent, PendingEvents, UnitOfWorkError, aggregate};
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Debug, Serialize, Deserialize, DomainEvent)]
/// enum OrderEvent { Placed { customer: String } }
///
/// #[aggregate]
/// struct Order { id: String, pending_events: PendingEvents<OrderEvent> }
///
/// /// The service's code, for the real unit of work and the in-memory one alike.
/// fn place(events: &mut impl CollectEvents, id: &str) -> Order {
///     let mut order = Order { id: id.into(), pending_events: PendingEvents::new() };
///     order.record(OrderEvent::Placed { customer: "ada".into() });
///     events.track(&mut order);
///     order
/// }
///
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// let outbox = InMemoryOutbox::new();
/// let order = outbox
///     .transaction(async |uow| Ok::<_, UnitOfWorkError>(place(uow, "o-1")))
///     .await?;
/// assert!(order.pending_events().is_empty(), "drained on commit");
/// let written = outbox.written();
/// assert_eq!(written[0].subject, "events.Order.o-1.Placed");
/// assert_eq!((written[0].aggregate_seq, written[0].payload.as_str()), (1, r#"{"customer":"ada"}"#));
/// let OrderEvent::Placed { customer } = written[0].decode::<OrderEvent>()?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }).unwrap();
/// ```
pub struct InMemoryOutbox {
    outbox: Outbox,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    written: Vec<WrittenEvent>,
    sequences: HashMap<(String, String), i64>,
    dedup_keys: HashSet<String>,
}

/// An event an [`InMemoryOutbox`] unit of work wrote: the outbox row it would have inserted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WrittenEvent {
    /// The row id, the message's `Nats-Msg-Id` and `ce-id`.
    pub id: Uuid,
    /// The subject it would be published on.
    pub subject: String,
    /// The aggregate type.
    pub aggregate_type: String,
    /// The aggregate id.
    pub aggregate_id: String,
    /// Its place in its aggregate's sequence, from 1.
    pub aggregate_seq: i64,
    /// The event type.
    pub event_type: String,
    /// The event version.
    pub event_version: i32,
    /// The partition key.
    pub partition_key: String,
    /// The payload JSON, as serde wrote it.
    pub payload: String,
    /// The dedup key, if the event has one.
    pub dedup_key: Option<String>,
    /// The unit of work's correlation id.
    pub correlation_id: String,
    /// The unit of work's causation id.
    pub causation_id: String,
}

impl WrittenEvent {
    /// Decodes the payload as a consumer would, by event type and version.
    ///
    /// # Errors
    /// As [`EventSet::decode`].
    pub fn decode<E: EventSet>(&self) -> Result<E, PayloadError> {
        E::decode(
            &self.event_type,
            self.event_version,
            self.payload.as_bytes(),
        )
    }
}

impl InMemoryOutbox {
    /// An in-memory outbox with the default topology (subject prefix `events`).
    pub fn new() -> Self {
        Self::with_topology(Topology::default())
    }

    /// An in-memory outbox with `topology`'s subject prefix.
    pub fn with_topology(topology: Topology) -> Self {
        Self {
            outbox: Outbox::with_topology(topology),
            state: Mutex::new(State::default()),
        }
    }

    /// This in-memory outbox with another payload bound, as [`Outbox::with_max_payload`]
    /// sets it for the real one (default
    /// [`DEFAULT_MAX_PAYLOAD_BYTES`](crate::outbox::DEFAULT_MAX_PAYLOAD_BYTES)).
    pub fn with_max_payload(mut self, bytes: usize) -> Self {
        self.outbox = self.outbox.with_max_payload(bytes);
        self
    }

    /// Runs `f` as a unit of work: when it returns `Ok`, its events are checked, numbered
    /// and kept, and its tracked aggregates drained, as [`Outbox::transaction`] would commit
    /// them; when it fails, or an event is invalid, nothing is kept and the aggregates keep
    /// their pending events.
    ///
    /// # Errors
    /// `f`'s own error, or the [`UnitOfWorkError`] the real unit of work would return for
    /// the same events (an invalid subject token, a payload that does not serialize or is
    /// over the outbox's `max_payload`, a taken dedup key with [`DuplicateEvents::Fail`]).
    pub async fn transaction<T, E, F>(&self, f: F) -> Result<T, E>
    where
        F: for<'u, 'o> AsyncFnOnce(&'u mut InMemoryUnitOfWork<'o>) -> Result<T, E>,
        E: From<UnitOfWorkError>,
    {
        let mut unit = InMemoryUnitOfWork {
            buffer: EventBuffer::new(&self.outbox, Causality::root()),
        };
        let value = f(&mut unit).await?;
        let duplicates = unit.buffer.duplicates;
        let causality = unit.buffer.causality.clone();
        let (mut events, drains) = unit.buffer.take()?;
        {
            let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
            let mut seen = HashSet::new();
            let taken: Vec<usize> = events
                .iter()
                .enumerate()
                .filter(|(_, e)| {
                    e.dedup_key.as_ref().is_some_and(|key| {
                        state.dedup_keys.contains(key) || !seen.insert(key.clone())
                    })
                })
                .map(|(position, _)| position)
                .collect();
            drop_duplicates(&mut events, &taken, duplicates)?;
            for event in events {
                if let Some(key) = &event.dedup_key {
                    state.dedup_keys.insert(key.clone());
                }
                let seq = state
                    .sequences
                    .entry((event.aggregate_type.clone(), event.aggregate_id.clone()))
                    .or_default();
                *seq += 1;
                let aggregate_seq = *seq;
                state.written.push(WrittenEvent {
                    id: event.id,
                    subject: event.subject,
                    aggregate_type: event.aggregate_type,
                    aggregate_id: event.aggregate_id,
                    aggregate_seq,
                    event_type: event.event_type.to_owned(),
                    event_version: event.event_version,
                    partition_key: event.partition_key,
                    payload: event.payload,
                    dedup_key: event.dedup_key,
                    correlation_id: causality.correlation_id.clone(),
                    causation_id: causality.causation_id.clone(),
                });
            }
        }
        for (handle, count) in drains {
            handle.mark_committed(count);
        }
        Ok(value)
    }

    /// Every event written so far, in commit order.
    pub fn written(&self) -> Vec<WrittenEvent> {
        self.state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .written
            .clone()
    }

    /// Every event written so far, removed from the outbox (sequences and dedup keys stay).
    pub fn take_written(&self) -> Vec<WrittenEvent> {
        std::mem::take(&mut self.state.lock().unwrap_or_else(|e| e.into_inner()).written)
    }
}

impl Default for InMemoryOutbox {
    fn default() -> Self {
        Self::new()
    }
}

/// The unit of work of an [`InMemoryOutbox`]: [`UnitOfWork`](crate::UnitOfWork)'s event side, without a
/// connection.
pub struct InMemoryUnitOfWork<'o> {
    buffer: EventBuffer<'o>,
}

impl InMemoryUnitOfWork<'_> {
    /// As [`UnitOfWork::track`](crate::UnitOfWork::track).
    pub fn track<A: Aggregate>(&mut self, aggregate: &mut A) {
        self.buffer.track(aggregate);
    }

    /// As [`UnitOfWork::emit`](crate::UnitOfWork::emit).
    pub fn emit<E: DomainEvent>(&mut self, aggregate_type: &str, aggregate_id: &str, event: &E) {
        self.buffer.emit(aggregate_type, aggregate_id, event);
    }

    /// As [`UnitOfWork::set_correlation`](crate::UnitOfWork::set_correlation).
    pub fn set_correlation(
        &mut self,
        correlation_id: impl Into<String>,
        causation_id: impl Into<String>,
    ) {
        self.buffer
            .set_correlation(correlation_id.into(), causation_id.into());
    }

    /// As [`UnitOfWork::set_duplicate_events`](crate::UnitOfWork::set_duplicate_events).
    pub fn set_duplicate_events(&mut self, duplicates: DuplicateEvents) {
        self.buffer.duplicates = duplicates;
    }

    /// As [`UnitOfWork::event_count`](crate::UnitOfWork::event_count).
    pub fn event_count(&self) -> usize {
        self.buffer.event_count()
    }
}

impl CollectEvents for InMemoryUnitOfWork<'_> {
    fn track<A: Aggregate>(&mut self, aggregate: &mut A) {
        InMemoryUnitOfWork::track(self, aggregate);
    }

    fn emit<E: DomainEvent>(&mut self, aggregate_type: &str, aggregate_id: &str, event: &E) {
        InMemoryUnitOfWork::emit(self, aggregate_type, aggregate_id, event);
    }
}

// ---- End to end --------------------------------------------------------------------------

/// A throwaway PostgreSQL database, migrated, with a subject prefix and a JetStream stream of
/// its own: tests that each take one run in parallel, and twice in a row, against real
/// servers. The database and the stream are removed when it drops.
///
/// `OUTBOX_TEST_DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/postgres`) names
/// the server and a database to connect to for `CREATE DATABASE`; `NATS_URL` (default
/// `nats://127.0.0.1:4222`) the broker.
///
/// ```
/// use std::time::Duration;
/// use outbox_runtime::testing::TestEnv;
/// use outbox_runtime::{DomainEvent, PendingEvents, Relay, aggregate};
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Debug, Serialize, Deserialize, DomainEvent)]
/// enum OrderEvent { Placed { customer: String }, Shipped }
///
/// #[aggregate]
/// struct Order { id: String, pending_events: PendingEvents<OrderEvent> }
///
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let env = TestEnv::new().await;
/// let mut order = Order { id: "o-1".into(), pending_events: PendingEvents::new() };
/// order.record(OrderEvent::Placed { customer: "ada".into() });
/// order.record(OrderEvent::Shipped);
/// env.commit(&mut order).await;
///
/// let relay = Relay::connect(env.relay_config(), env.nats.clone()).await?.spawn();
/// let placed = OrderEvent::Placed { customer: "ada".into() };
/// let messages = env.wait_for_events(&[placed, OrderEvent::Shipped], Duration::from_secs(10)).await;
/// assert_eq!(messages[1].subject, format!("{}.Order.o-1.Shipped", env.prefix));
/// relay.shutdown().await?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }).unwrap();
/// ```
#[cfg(feature = "postgres")]
pub struct TestEnv {
    /// The URL of this environment's own database.
    pub database_url: String,
    /// A client of the NATS server.
    pub nats: async_nats::Client,
    /// This environment's subject prefix (one token, `t` and 16 hex digits).
    pub prefix: String,
    /// This environment's stream, capturing `{prefix}.>` (created by the first relay, as in
    /// production, or by [`create_stream`](Self::create_stream)).
    pub stream: String,
    admin_url: String,
    database: String,
    nats_url: String,
}

/// A message as a consumer received it from the stream.
#[cfg(feature = "postgres")]
#[derive(Clone, Debug)]
pub struct StoredMessage {
    /// Its subject.
    pub subject: String,
    /// Its headers, every value of each.
    pub headers: async_nats::HeaderMap,
    /// Its payload.
    pub payload: Vec<u8>,
}

#[cfg(feature = "postgres")]
impl StoredMessage {
    /// The value of header `name`.
    ///
    /// # Panics
    /// When the message has no such header, naming it and the subject.
    #[track_caller]
    pub fn header(&self, name: &str) -> String {
        self.headers
            .get(name)
            .unwrap_or_else(|| panic!("header {name} on {}", self.subject))
            .as_str()
            .to_owned()
    }

    fn wire(&self) -> Option<(String, i32, serde_json::Value)> {
        let header = |name: &str| self.headers.get(name).map(|v| v.as_str().to_owned());
        let version = header("ce-eventversion").map_or(Some(1), |v| v.parse().ok())?;
        let payload = serde_json::from_slice(&self.payload).ok()?;
        Some((header("ce-type")?, version, payload))
    }
}

/// A stream [`TestEnv`] keeps on every nats-server and never deletes (file storage, on the
/// subject `outbox-test-store-anchor`, which nothing publishes to).
///
/// nats-server 2.9.10 removes an account's store directory (`jetstream/$G`) when the last
/// stream with file storage is deleted from it, and a stream created at that moment fails:
/// "could not create storage directory - mkdir .../$G/streams: no such file or directory"
/// (JetStream error 10049, seen in this suite's CI, where tests create and delete streams in
/// parallel). 2.15.1 removes it too, now and then (one deletion in thirty here, seen in CI
/// on 2026-12-04). This stream keeps it on both.
#[cfg(feature = "postgres")]
pub const STORE_ANCHOR: &str = "OUTBOX_TEST_STORE_ANCHOR";

/// Creates [`STORE_ANCHOR`], once per server (a second identical create changes nothing);
/// best effort: a server that refuses it leaves the tests as they were.
#[cfg(feature = "postgres")]
async fn anchor_the_store(nats: &async_nats::Client) {
    let anchor = jetstream::stream::Config {
        name: STORE_ANCHOR.to_owned(),
        subjects: vec!["outbox-test-store-anchor".to_owned()],
        storage: jetstream::stream::StorageType::File,
        ..Default::default()
    };
    if let Err(error) = jetstream::new(nats.clone())
        .get_or_create_stream(anchor)
        .await
    {
        tracing::debug!(%error, "the test store's anchor stream was not created");
    }
}

/// `OUTBOX_TEST_DATABASE_URL`, or the local server's `postgres` database.
#[cfg(feature = "postgres")]
pub fn admin_url() -> String {
    std::env::var("OUTBOX_TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned())
}

/// `NATS_URL`, or the local server.
pub fn nats_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned())
}

#[cfg(feature = "postgres")]
impl TestEnv {
    /// A fresh, migrated database and a unique prefix and stream name, on [`nats_url`].
    ///
    /// # Panics
    /// When PostgreSQL or NATS cannot be reached, or the migrations fail.
    pub async fn new() -> Self {
        Self::with_nats(&nats_url()).await
    }

    /// The same, on the NATS server at `nats_url`.
    ///
    /// # Panics
    /// As [`new`](Self::new).
    pub async fn with_nats(nats_url: &str) -> Self {
        let env = Self::unmigrated(nats_url).await;
        env.migrate().await;
        env
    }

    /// A fresh database without the outbox tables, on the NATS server at `nats_url`.
    ///
    /// # Panics
    /// When PostgreSQL or NATS cannot be reached.
    pub async fn unmigrated(nats_url: &str) -> Self {
        let nats = crate::nats::connect(nats_url)
            .await
            .unwrap_or_else(|e| panic!("NATS at {nats_url} is not reachable: {e}"));
        Self::create(nats, nats_url).await
    }

    /// A fresh, migrated database, with a NATS client the test connected itself (with
    /// credentials a URL cannot carry); `nats_url` is where the cleanup connects.
    ///
    /// # Panics
    /// As [`new`](Self::new).
    pub async fn with_client(nats: async_nats::Client, nats_url: &str) -> Self {
        let env = Self::create(nats, nats_url).await;
        env.migrate().await;
        env
    }

    async fn create(nats: async_nats::Client, nats_url: &str) -> Self {
        anchor_the_store(&nats).await;
        let tag = Uuid::new_v4().simple().to_string()[..16].to_owned();
        let admin_url = admin_url();
        let database = format!("outbox_test_{tag}");
        let mut admin = AsyncPgConnection::establish(&admin_url)
            .await
            .unwrap_or_else(|e| panic!("PostgreSQL at {admin_url} is not reachable: {e}"));
        admin
            .batch_execute(&format!("CREATE DATABASE {database}"))
            .await
            .unwrap_or_else(|e| panic!("CREATE DATABASE {database}: {e}"));
        let database_url = match admin_url.rsplit_once('/') {
            Some((server, _)) => format!("{server}/{database}"),
            None => panic!("OUTBOX_TEST_DATABASE_URL has no database part: {admin_url}"),
        };
        Self {
            database_url,
            nats,
            prefix: format!("t{tag}"),
            stream: format!("TEST_{}", tag.to_uppercase()),
            admin_url,
            database,
            nats_url: nats_url.to_owned(),
        }
    }

    async fn migrate(&self) {
        crate::run_migrations(&self.database_url)
            .await
            .unwrap_or_else(|e| panic!("the outbox migrations on {}: {e}", self.database));
    }

    /// The NATS server's URL, as given.
    pub fn nats_url(&self) -> &str {
        &self.nats_url
    }

    /// A new connection to this environment's database.
    ///
    /// # Panics
    /// When it cannot connect.
    pub async fn conn(&self) -> AsyncPgConnection {
        AsyncPgConnection::establish(&self.database_url)
            .await
            .unwrap_or_else(|e| panic!("connect to {}: {e}", self.database))
    }

    /// This environment's topology: its prefix and stream.
    pub fn topology(&self) -> Topology {
        Topology::new(
            self.prefix.parse().expect("a valid prefix"),
            StreamSettings {
                name: self.stream.clone(),
                ..StreamSettings::default()
            },
        )
    }

    /// An outbox with this environment's topology.
    pub fn outbox(&self) -> Outbox {
        Outbox::with_topology(self.topology())
    }

    /// Commits `aggregate`'s pending events through this environment's outbox, in a unit of
    /// work of their own on a fresh connection.
    ///
    /// # Panics
    /// When the unit of work fails.
    pub async fn commit(&self, aggregate: &mut impl Aggregate) {
        self.outbox()
            .transaction(&mut self.conn().await, async |uow| {
                uow.track(aggregate);
                Ok::<_, UnitOfWorkError>(())
            })
            .await
            .unwrap_or_else(|e| panic!("commit the aggregate's events: {e}"));
    }

    /// A relay configuration for this environment's database, prefix and stream, polling
    /// every 20 ms, with `source` `/tests`.
    pub fn relay_config(&self) -> RelayConfig {
        let mut config = RelayConfig::new(&self.database_url);
        config.topology = self.topology();
        config.source = "/tests".to_owned();
        config.poll_interval = Duration::from_millis(20);
        config
    }

    /// A JetStream context on [`nats`](Self::nats).
    pub fn jetstream(&self) -> jetstream::Context {
        jetstream::new(self.nats.clone())
    }

    /// Creates this environment's stream, capturing `{prefix}.>`, with `duplicate_window`
    /// (before a relay does, for a test that needs it first or with another window).
    ///
    /// # Panics
    /// When JetStream refuses it.
    pub async fn create_stream(&self, duplicate_window: Duration) {
        self.jetstream()
            .create_stream(jetstream::stream::Config {
                name: self.stream.clone(),
                subjects: vec![format!("{}.>", self.prefix)],
                duplicate_window,
                ..Default::default()
            })
            .await
            .unwrap_or_else(|e| panic!("create the stream {}: {e}", self.stream));
    }

    /// How many messages this environment's stream holds (0 before it exists).
    pub async fn stream_len(&self) -> u64 {
        match self.jetstream().get_stream(&self.stream).await {
            Ok(mut stream) => stream.info().await.map_or(0, |info| info.state.messages),
            Err(_) => 0,
        }
    }

    /// Waits until this environment's stream holds at least `count` messages.
    ///
    /// # Panics
    /// After `timeout`, with how many it holds.
    pub async fn until_stream_holds(&self, count: u64, timeout: Duration) {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let held = self.stream_len().await;
            if held >= count {
                return;
            }
            if tokio::time::Instant::now() >= deadline {
                panic!(
                    "the stream {} holds {held} messages, not {count}, after {timeout:?}",
                    self.stream
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Every message in this environment's stream, in stream order, read by an ordered
    /// consumer (which, unlike the stream's raw-get API in async-nats 0.51, keeps every value
    /// of a multi-valued header).
    ///
    /// # Panics
    /// When the stream does not exist or cannot be read for 30 s, or a stored message is not
    /// delivered within 10 s.
    pub async fn stream_messages(&self) -> Vec<StoredMessage> {
        self.messages_in(&self.stream).await
    }

    /// Every message in the stream `name` (on this environment's server), in stream order, as
    /// [`stream_messages`](Self::stream_messages) reads its own stream's: a stream the test
    /// made besides, such as a replay's.
    ///
    /// # Panics
    /// As [`stream_messages`](Self::stream_messages).
    pub async fn messages_in(&self, name: &str) -> Vec<StoredMessage> {
        // On a cluster, a node that just rejoined may still hold a leader election or catch
        // up, and a JetStream API request made meanwhile times out; such requests are retried
        // for up to 30 s.
        let (stored, consumer) = retry_for(Duration::from_secs(30), || async {
            let mut stream = self
                .jetstream()
                .get_stream(name)
                .await
                .map_err(|e| format!("the stream {name}: {e}"))?;
            let stored = stream
                .info()
                .await
                .map_err(|e| format!("the stream {name}: {e}"))?
                .state
                .messages;
            let consumer = stream
                .create_consumer(pull::OrderedConfig {
                    deliver_policy: DeliverPolicy::All,
                    ..Default::default()
                })
                .await
                .map_err(|e| format!("an ordered consumer on {name}: {e}"))?;
            Ok((stored, consumer))
        })
        .await;
        let mut messages = consumer
            .messages()
            .await
            .unwrap_or_else(|e| panic!("consume {name}: {e}"));
        let mut received = Vec::new();
        while (received.len() as u64) < stored {
            let message = tokio::time::timeout(Duration::from_secs(10), messages.next())
                .await
                .unwrap_or_else(|_| {
                    panic!(
                        "message {} of {stored} not delivered in 10 s",
                        received.len() + 1
                    )
                })
                .expect("the consumer is open")
                .unwrap_or_else(|e| panic!("read {name}: {e}"));
            received.push(StoredMessage {
                subject: message.subject.to_string(),
                headers: message.headers.clone().unwrap_or_default(),
                payload: message.payload.to_vec(),
            });
        }
        received
    }

    /// Waits until `expected` are on this environment's stream, in this order (other
    /// messages may come between them), and returns the messages that matched. A message
    /// matches an event by `ce-type`, `ce-eventversion` and payload JSON.
    ///
    /// # Panics
    /// After `timeout`, listing the events not found and what the stream holds.
    pub async fn wait_for_events<E: DomainEvent>(
        &self,
        expected: &[E],
        timeout: Duration,
    ) -> Vec<StoredMessage> {
        let wanted: Vec<(&str, i32, Option<serde_json::Value>)> = expected
            .iter()
            .map(|event| {
                let payload = event.to_payload().ok();
                let json = payload.and_then(|p| serde_json::from_str(&p).ok());
                (event.event_type(), event.event_version(), json)
            })
            .collect();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let messages = if self.stream_len().await > 0 {
                self.stream_messages().await
            } else {
                Vec::new()
            };
            let mut matched = Vec::new();
            let mut next = wanted.iter();
            let mut want = next.next();
            for message in &messages {
                let Some((event_type, version, payload)) = want else {
                    break;
                };
                if message.wire().is_some_and(|(t, v, p)| {
                    t == *event_type && v == *version && Some(&p) == payload.as_ref()
                }) {
                    matched.push(message.clone());
                    want = next.next();
                }
            }
            if matched.len() == wanted.len() {
                return matched;
            }
            if tokio::time::Instant::now() >= deadline {
                let mut text = String::new();
                for (t, v, p) in &wanted[matched.len()..] {
                    let p = p
                        .as_ref()
                        .map_or("(payload does not serialize)".to_owned(), |p| p.to_string());
                    let _ = writeln!(text, "  missing: {t} v{v} {p}");
                }
                for message in &messages {
                    let payload = String::from_utf8_lossy(&message.payload);
                    let _ = writeln!(text, "  stored:  {} {payload}", message.subject);
                }
                panic!(
                    "after {timeout:?}, {} of {} events are on the stream {} in order:\n{text}",
                    matched.len(),
                    wanted.len(),
                    self.stream
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

#[cfg(feature = "postgres")]
impl Drop for TestEnv {
    fn drop(&mut self) {
        let admin_url = self.admin_url.clone();
        let database = self.database.clone();
        let stream = self.stream.clone();
        let nats_url = self.nats_url.clone();
        // Drop cannot await, so the cleanup runs on a thread and runtime of its own, with
        // connections of its own: the test's NATS client is driven by the test's runtime,
        // which may be blocked in this very drop.
        let cleanup = std::thread::spawn(move || {
            let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            runtime.block_on(async move {
                let connect = async {
                    let (options, servers) = crate::nats::options(&nats_url).ok()?;
                    options
                        .connection_timeout(Duration::from_secs(2))
                        .connect(servers)
                        .await
                        .ok()
                };
                if let Some(nats) = connect.await {
                    let _ = jetstream::new(nats).delete_stream(&stream).await;
                }
                if let Ok(mut admin) = AsyncPgConnection::establish(&admin_url).await {
                    let _ = admin
                        .batch_execute(&format!("DROP DATABASE IF EXISTS {database} WITH (FORCE)"))
                        .await;
                }
            });
        });
        let _ = cleanup.join();
    }
}

/// Runs `attempt` until it succeeds, pausing 200 ms between failures.
///
/// # Panics
/// When it still fails after `budget`, with the last error.
#[cfg(feature = "postgres")]
async fn retry_for<T, F, Fut>(budget: Duration, mut attempt: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, String>>,
{
    let deadline = tokio::time::Instant::now() + budget;
    loop {
        match attempt().await {
            Ok(value) => return value,
            Err(e) if tokio::time::Instant::now() >= deadline => {
                panic!("{e} (still failing after {budget:?})")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}
