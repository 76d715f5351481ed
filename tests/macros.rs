//! What `#[derive(DomainEvent)]` and `#[aggregate]` generate, used as a user would (no
//! services needed). The compile errors are pinned in `ui-tests/`.

use diesel::query_builder::debug_query;
use diesel::{Insertable, pg::Pg};
use outbox_runtime::{Aggregate, DomainEvent, EventType, PendingEvents, aggregate};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, DomainEvent)]
pub enum AccountEvent {
    Opened {
        owner: String,
    },
    #[event(name = "Deposited", version = 2)]
    DepositedV2 {
        amount_cents: i64,
        #[event(partition_key)]
        branch: String,
    },
    #[event(name = "Deposited")]
    DepositedV1 {
        amount: f64,
    },
    Frozen,
    Renamed(Rename),
    #[allow(non_camel_case_types)] // a raw identifier: the event type is `type`
    r#type {
        kind: String,
    },
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Rename {
    to: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, DomainEvent)]
#[event(version = 3)]
struct LimitRaised {
    #[event(partition_key)]
    region: u16,
    limit_cents: i64,
}

#[derive(Debug, PartialEq, DomainEvent)]
struct Closed;

#[test]
fn event_types_versions_and_partition_keys() {
    let types: Vec<(&str, i32)> = AccountEvent::EVENT_TYPES
        .iter()
        .map(|t: &EventType| (t.name, t.version))
        .collect();
    assert_eq!(
        types,
        [
            ("Opened", 1),
            ("Deposited", 2),
            ("Deposited", 1),
            ("Frozen", 1),
            ("Renamed", 1),
            ("type", 1)
        ]
    );
    let deposit = AccountEvent::DepositedV2 {
        amount_cents: 500,
        branch: "north".into(),
    };
    assert_eq!(
        (deposit.event_type(), deposit.event_version()),
        ("Deposited", 2)
    );
    assert_eq!(deposit.partition_key().as_deref(), Some("north"));
    assert_eq!(AccountEvent::Frozen.partition_key(), None);

    let raised = LimitRaised {
        region: 7,
        limit_cents: 1,
    };
    assert_eq!(
        (raised.event_type(), raised.event_version()),
        ("LimitRaised", 3)
    );
    assert_eq!(raised.partition_key().as_deref(), Some("7"));
    assert_eq!(Closed.event_type(), "Closed");
}

#[test]
fn payloads_round_trip_and_decode_dispatches_on_type_and_version() {
    let events = [
        AccountEvent::Opened {
            owner: "ada".into(),
        },
        AccountEvent::DepositedV2 {
            amount_cents: 500,
            branch: "north".into(),
        },
        AccountEvent::DepositedV1 { amount: 5.0 },
        AccountEvent::Frozen,
        AccountEvent::Renamed(Rename { to: "bob".into() }),
        AccountEvent::r#type { kind: "x".into() },
    ];
    let payloads = [
        r#"{"owner":"ada"}"#,
        r#"{"amount_cents":500,"branch":"north"}"#,
        r#"{"amount":5.0}"#,
        "{}",
        r#"{"to":"bob"}"#,
        r#"{"kind":"x"}"#,
    ];
    for (event, payload) in events.iter().zip(payloads) {
        assert_eq!(event.to_payload().unwrap(), payload);
        let back = AccountEvent::from_payload(
            event.event_type(),
            event.event_version(),
            payload.as_bytes(),
        )
        .unwrap();
        assert_eq!(&back, event);
    }
    // The same name at version 1 decodes the old shape.
    let old = AccountEvent::from_payload("Deposited", 1, br#"{"amount":1.5}"#).unwrap();
    assert_eq!(old, AccountEvent::DepositedV1 { amount: 1.5 });
    assert!(AccountEvent::from_payload("Deposited", 3, b"{}").is_err());

    let raised = LimitRaised {
        region: 7,
        limit_cents: 1,
    };
    let payload = raised.to_payload().unwrap();
    assert_eq!(
        LimitRaised::from_payload("LimitRaised", 3, payload.as_bytes()).unwrap(),
        raised
    );
    let error = LimitRaised::from_payload("LimitRaised", 1, payload.as_bytes()).unwrap_err();
    assert!(error.to_string().contains("LimitRaised v3"), "{error}");

    assert_eq!(Closed.to_payload().unwrap(), "{}");
    assert_eq!(Closed::from_payload("Closed", 1, b"{}").unwrap(), Closed);
}

diesel::table! {
    accounts (number) {
        number -> Text,
        owner -> Text,
    }
}

/// An aggregate that is also a serde value and a diesel insertable: the injected buffer
/// stays out of both.
#[aggregate(name = "Account")]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, Insertable)]
#[diesel(table_name = accounts)]
pub struct BankAccount {
    #[aggregate_id]
    number: String,
    owner: String,
    pending_events: PendingEvents<AccountEvent>,
}

#[test]
fn an_aggregate_has_a_type_an_id_and_a_buffer_that_other_derives_skip() {
    let mut account = BankAccount {
        number: "acc-1".into(),
        owner: "ada".into(),
        pending_events: PendingEvents::new(),
    };
    assert_eq!(BankAccount::AGGREGATE_TYPE, "Account");
    assert_eq!(account.aggregate_id(), "acc-1");
    account.record(AccountEvent::Frozen);
    assert_eq!(account.pending_events(), [AccountEvent::Frozen]);

    let json = serde_json::to_value(&account).unwrap();
    assert_eq!(json, serde_json::json!({"number": "acc-1", "owner": "ada"}));
    let back: BankAccount = serde_json::from_value(json).unwrap();
    assert!(back.pending_events().is_empty());

    let sql =
        debug_query::<Pg, _>(&diesel::insert_into(accounts::table).values(&account)).to_string();
    assert!(
        sql.starts_with("INSERT INTO \"accounts\" (\"number\", \"owner\") VALUES ($1, $2)"),
        "{sql}"
    );

    // A clone owns its pending events.
    let clone = account.clone();
    assert_eq!(clone, account);
    assert_eq!(clone.pending_events().len(), 1);
}

/// An aggregate in another module, generic, with the trait used generically.
mod generic {
    use super::*;

    #[aggregate]
    pub struct Ledger<T: std::fmt::Display> {
        pub id: T,
        pub pending_events: PendingEvents<AccountEvent>,
    }

    pub fn pending<A: Aggregate>(aggregate: &A) -> usize {
        aggregate.pending_events().len()
    }
}

#[test]
fn aggregates_may_be_generic_and_are_usable_through_the_trait() {
    let mut ledger = generic::Ledger {
        id: 42_u64,
        pending_events: PendingEvents::new(),
    };
    ledger.record(AccountEvent::Frozen);
    assert_eq!(generic::Ledger::<u64>::AGGREGATE_TYPE, "Ledger");
    assert_eq!(ledger.aggregate_id(), "42");
    assert_eq!(generic::pending(&ledger), 1);
}

/// Raw identifiers name an aggregate and find its id without their `r#`, as serde and the
/// events name them: the aggregate type was `r#match` (a subject `events.r#match...`), and a
/// field `r#id` was no id.
#[allow(non_camel_case_types)] // a raw identifier: the aggregate type is `match`
mod raw {
    use super::*;

    #[aggregate]
    pub struct r#match {
        pub r#id: String,
        pub pending_events: PendingEvents<AccountEvent>,
    }
}

#[test]
fn raw_identifiers_name_an_aggregate_and_its_id_without_their_prefix() {
    let mut fixture = raw::r#match {
        r#id: "m-1".into(),
        pending_events: PendingEvents::new(),
    };
    fixture.record(AccountEvent::r#type { kind: "x".into() });
    assert_eq!(raw::r#match::AGGREGATE_TYPE, "match");
    assert_eq!(fixture.aggregate_id(), "m-1");
    assert_eq!(fixture.pending_events()[0].event_type(), "type");
}

/// A generic event: an event for every type argument that makes it serde-able, `Send` and
/// `'static`; its type name is the item's, without the arguments.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, DomainEvent)]
enum Renamed<Name> {
    Renamed { from: Name, to: Name },
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, DomainEvent)]
struct Tagged<T> {
    tag: T,
}

#[aggregate]
struct Directory {
    id: String,
    pending_events: PendingEvents<Renamed<String>>,
}

#[test]
fn events_may_be_generic_over_their_field_types() {
    fn event_types<E: DomainEvent>() -> &'static [EventType] {
        E::EVENT_TYPES
    }
    let renamed = Renamed::Renamed {
        from: "a".to_owned(),
        to: "b".to_owned(),
    };
    let mut directory = Directory {
        id: "d-1".into(),
        pending_events: PendingEvents::new(),
    };
    directory.record(renamed.clone());
    assert_eq!(directory.pending_events(), std::slice::from_ref(&renamed));
    let payload = renamed.to_payload().unwrap();
    assert_eq!(payload, r#"{"from":"a","to":"b"}"#);
    assert_eq!(
        Renamed::<String>::from_payload("Renamed", 1, payload.as_bytes()).unwrap(),
        renamed
    );

    let tagged = Tagged { tag: 7_u8 };
    assert_eq!(tagged.event_type(), "Tagged");
    assert_eq!(tagged.to_payload().unwrap(), r#"{"tag":7}"#);
    assert_eq!(
        Tagged::<u8>::from_payload("Tagged", 1, br#"{"tag":7}"#).unwrap(),
        tagged
    );
    assert_eq!(event_types::<Tagged<u8>>(), event_types::<Tagged<String>>());
}

/// serde's names name the event types: a variant's `rename`, else the enum's `rename_all`;
/// `#[event(name)]` still comes first.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, DomainEvent)]
#[serde(rename_all = "kebab-case")]
enum TransferEvent {
    TransferRequested {
        cents: i64,
    },
    #[serde(rename = "money-moved")]
    FundsMoved {
        cents: i64,
    },
    #[event(name = "Refused")]
    TransferRefused,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, DomainEvent)]
#[serde(rename = "limit_lowered")]
struct LimitLowered {
    cents: i64,
}

#[test]
fn serde_renames_name_the_event_types_and_payloads_round_trip() {
    let names: Vec<&str> = TransferEvent::EVENT_TYPES.iter().map(|t| t.name).collect();
    assert_eq!(names, ["transfer-requested", "money-moved", "Refused"]);
    let moved = TransferEvent::FundsMoved { cents: 7 };
    assert_eq!(moved.event_type(), "money-moved");
    let payload = moved.to_payload().unwrap();
    assert_eq!(payload, r#"{"cents":7}"#);
    assert_eq!(
        TransferEvent::from_payload("money-moved", 1, payload.as_bytes()).unwrap(),
        moved
    );
    assert!(TransferEvent::from_payload("FundsMoved", 1, payload.as_bytes()).is_err());

    let lowered = LimitLowered { cents: 3 };
    assert_eq!(lowered.event_type(), "limit_lowered");
    assert_eq!(
        LimitLowered::from_payload("limit_lowered", 1, br#"{"cents":3}"#).unwrap(),
        lowered
    );
}

mod event_set {
    use outbox_runtime::{DomainEvent, EventSet, EventType, PayloadError};
    use serde::{Deserialize, Serialize};

    #[derive(Debug, PartialEq, Serialize, Deserialize, DomainEvent)]
    pub enum AccountEvent {
        Opened {
            owner: String,
        },
        #[event(name = "Credited", version = 2)]
        CreditedV2 {
            cents: i64,
        },
    }

    #[derive(Debug, PartialEq, Serialize, Deserialize, DomainEvent)]
    pub struct TransferRequested {
        pub cents: i64,
    }

    #[derive(Debug, PartialEq, EventSet)]
    pub enum BankEvent {
        Account(AccountEvent),
        Transfer(TransferRequested),
    }

    #[test]
    fn a_set_decodes_each_member_by_type_and_version_and_names_what_it_carries() {
        assert_eq!(
            BankEvent::decode("Credited", 2, br#"{"cents":7}"#).unwrap(),
            BankEvent::Account(AccountEvent::CreditedV2 { cents: 7 })
        );
        assert_eq!(
            BankEvent::decode("TransferRequested", 1, br#"{"cents":5}"#).unwrap(),
            BankEvent::Transfer(TransferRequested { cents: 5 })
        );
        let types: Vec<EventType> = BankEvent::event_types().collect();
        assert_eq!(types.len(), 3);
        assert_eq!(BankEvent::MEMBERS.len(), 2);

        // A version no member carries, and a payload its member cannot read.
        let unknown = BankEvent::decode("Credited", 1, br#"{"cents":7}"#).unwrap_err();
        assert!(
            matches!(&unknown, PayloadError::UnknownEventType { known, .. } if known.len() == 3),
            "{unknown:?}"
        );
        let text = unknown.to_string();
        assert!(
            text.contains("BankEvent")
                && text.contains("Credited v2")
                && text.contains("TransferRequested v1"),
            "{text}"
        );
        let bad = BankEvent::decode("TransferRequested", 1, br#"{"cents":"five"}"#).unwrap_err();
        assert!(matches!(bad, PayloadError::Json { .. }), "{bad:?}");

        // Every DomainEvent is a set of itself.
        assert_eq!(
            <TransferRequested as EventSet>::decode("TransferRequested", 1, br#"{"cents":1}"#)
                .unwrap(),
            TransferRequested { cents: 1 }
        );
    }
}

/// `#[event(upcast(..))]`: older versions read into the current type, one version at a
/// time, through typed and JSON steps in any mix the chain allows.
mod upcasting {
    use outbox_runtime::{DomainEvent, EventSet, EventType, PayloadError, UpcastError};
    use serde::{Deserialize, Serialize};
    use serde_json::{Value, json};

    /// Version 4. Version 3 kept its type; versions 1 and 2 are JSON only.
    #[derive(Debug, PartialEq, Serialize, Deserialize, DomainEvent)]
    #[event(name = "PriceChanged", version = 4)]
    #[event(upcast(from = 3, type = PriceChangedV3))]
    #[event(upcast(from = 1, json = cents_from_float), upcast(from = 2, json = add_currency))]
    struct PriceChanged {
        sku: String,
        cents: i64,
        currency: String,
        #[serde(default)]
        reason: Option<String>,
    }

    #[derive(Deserialize)]
    struct PriceChangedV3 {
        sku: String,
        cents: i64,
        currency: String,
    }

    impl From<PriceChangedV3> for PriceChanged {
        fn from(v3: PriceChangedV3) -> Self {
            Self {
                sku: v3.sku,
                cents: v3.cents,
                currency: v3.currency,
                reason: Some("before v4".into()),
            }
        }
    }

    /// v1 `{"sku", "price": 1.5}` -> v2 `{"sku", "cents": 150}`.
    fn cents_from_float(v1: Value) -> Result<Value, UpcastError> {
        let price = v1["price"].as_f64().ok_or("v1 price is not a number")?;
        Ok(json!({ "sku": v1["sku"], "cents": (price * 100.0).round() as i64 }))
    }

    /// v2 -> v3: the currency was always euros.
    fn add_currency(mut v2: Value) -> Result<Value, String> {
        let Some(object) = v2.as_object_mut() else {
            return Err(format!("not an object: {v2}"));
        };
        object.insert("currency".into(), "EUR".into());
        Ok(v2)
    }

    fn read(version: i32, payload: &str) -> Result<PriceChanged, PayloadError> {
        PriceChanged::from_payload("PriceChanged", version, payload.as_bytes())
    }

    #[test]
    fn every_older_version_reaches_the_current_type() {
        let expected = |reason: Option<&str>| PriceChanged {
            sku: "a-1".into(),
            cents: 150,
            currency: "EUR".into(),
            reason: reason.map(str::to_owned),
        };
        assert_eq!(
            read(1, r#"{"sku":"a-1","price":1.5}"#).unwrap(),
            expected(Some("before v4"))
        );
        assert_eq!(
            read(2, r#"{"sku":"a-1","cents":150}"#).unwrap(),
            expected(Some("before v4"))
        );
        let v3 = r#"{"sku":"a-1","cents":150,"currency":"EUR"}"#;
        assert_eq!(read(3, v3).unwrap(), expected(Some("before v4")));
        let v4 = r#"{"sku":"a-1","cents":150,"currency":"EUR"}"#;
        assert_eq!(read(4, v4).unwrap(), expected(None));
        // What the type writes is the current version only.
        let event = expected(None);
        assert_eq!(event.event_version(), 4);
        let types: Vec<(&str, i32)> = PriceChanged::EVENT_TYPES
            .iter()
            .map(|t: &EventType| (t.name, t.version))
            .collect();
        assert_eq!(
            types,
            [
                ("PriceChanged", 4),
                ("PriceChanged", 1),
                ("PriceChanged", 2),
                ("PriceChanged", 3)
            ]
        );
    }

    #[test]
    fn a_refused_or_malformed_old_payload_is_an_error_that_names_its_version() {
        let refused = read(1, r#"{"sku":"a-1","price":"cheap"}"#).unwrap_err();
        assert!(
            matches!(
                refused,
                PayloadError::Upcast {
                    from_version: 1,
                    ..
                }
            ),
            "{refused:?}"
        );
        assert!(
            refused.to_string().contains("v1 price is not a number"),
            "{refused}"
        );
        let refused = read(2, "[1]").unwrap_err();
        assert!(
            matches!(
                refused,
                PayloadError::Upcast {
                    from_version: 2,
                    ..
                }
            ),
            "{refused:?}"
        );
        assert!(
            refused.to_string().contains("not an object: [1]"),
            "{refused}"
        );
        // An upcast's output that the next version's type cannot read: a JSON error at that
        // version (v2 -> v3 by JSON, read as `PriceChangedV3`).
        let missing = read(2, r#"{"sku":"a-1"}"#).unwrap_err();
        assert!(
            matches!(
                missing,
                PayloadError::Json {
                    event_version: 3,
                    ..
                }
            ),
            "{missing:?}"
        );
        let malformed = read(3, r#"{"sku":"a-1"}"#).unwrap_err();
        assert!(
            matches!(
                malformed,
                PayloadError::Json {
                    event_version: 3,
                    ..
                }
            ),
            "{malformed:?}"
        );
        assert!(matches!(
            read(0, "{}"),
            Err(PayloadError::UnknownEventType { .. })
        ));
        assert!(matches!(
            read(5, "{}"),
            Err(PayloadError::UnknownEventType { .. })
        ));
    }

    /// A variant upcasts into the enum; a chain may be typed all the way.
    #[derive(Debug, PartialEq, Serialize, Deserialize, DomainEvent)]
    enum CartEvent {
        #[event(version = 3, upcast(from = 1, type = AddedV1), upcast(from = 2, type = AddedV2))]
        Added {
            sku: String,
            quantity: u32,
        },
        #[event(version = 2, upcast(from = 1, json = emptied_v1))]
        Emptied {
            reason: String,
        },
        CheckedOut,
    }

    #[derive(Deserialize)]
    struct AddedV1 {
        sku: String,
    }

    #[derive(Deserialize)]
    struct AddedV2 {
        item: String,
        quantity: u32,
    }

    impl From<AddedV1> for AddedV2 {
        fn from(v1: AddedV1) -> Self {
            Self {
                item: v1.sku,
                quantity: 1,
            }
        }
    }

    impl From<AddedV2> for CartEvent {
        fn from(v2: AddedV2) -> Self {
            Self::Added {
                sku: v2.item,
                quantity: v2.quantity,
            }
        }
    }

    fn emptied_v1(_: Value) -> Result<Value, &'static str> {
        Ok(json!({ "reason": "unknown (v1)" }))
    }

    #[derive(Debug, outbox_runtime::EventSet)]
    enum ShopEvent {
        Cart(CartEvent),
        Price(PriceChanged),
    }

    /// A unit struct reads its old versions too (its payload is `{}` at every version).
    #[derive(Debug, PartialEq, DomainEvent)]
    #[event(version = 3, upcast(from = 1, json = drop_all), upcast(from = 2, json = drop_all))]
    struct Ping;

    fn drop_all(_: Value) -> Result<Value, UpcastError> {
        Ok(json!({}))
    }

    #[test]
    fn a_unit_struct_reads_its_old_versions() {
        for version in 1..=3 {
            assert_eq!(Ping::from_payload("Ping", version, b"{}").unwrap(), Ping);
        }
    }

    #[test]
    fn enum_variants_upcast_into_the_enum_and_event_sets_dispatch_old_versions() {
        let added = |quantity| CartEvent::Added {
            sku: "b-2".into(),
            quantity,
        };
        let decode = |name: &str, version, payload: &str| {
            CartEvent::from_payload(name, version, payload.as_bytes())
        };
        assert_eq!(decode("Added", 1, r#"{"sku":"b-2"}"#).unwrap(), added(1));
        assert_eq!(
            decode("Added", 2, r#"{"item":"b-2","quantity":5}"#).unwrap(),
            added(5)
        );
        assert_eq!(
            decode("Added", 3, r#"{"sku":"b-2","quantity":7}"#).unwrap(),
            added(7)
        );
        let emptied = decode("Emptied", 1, "{}").unwrap();
        assert_eq!(
            emptied,
            CartEvent::Emptied {
                reason: "unknown (v1)".into()
            }
        );
        assert_eq!(
            decode("CheckedOut", 1, "{}").unwrap(),
            CartEvent::CheckedOut
        );
        assert!(decode("CheckedOut", 0, "{}").is_err());

        let from_set = ShopEvent::decode("Added", 1, br#"{"sku":"b-2"}"#).unwrap();
        assert!(matches!(from_set, ShopEvent::Cart(event) if event == added(1)));
        let price = ShopEvent::decode("PriceChanged", 1, br#"{"sku":"a","price":2}"#).unwrap();
        assert!(matches!(
            price,
            ShopEvent::Price(PriceChanged { cents: 200, .. })
        ));
        let unknown = ShopEvent::decode("Added", 4, b"{}").unwrap_err();
        let known = unknown.to_string();
        assert!(known.contains("Added v3, Added v1, Added v2"), "{known}");
    }
}

/// `#[event(dedup_key)]`: the field's value is the event's idempotency key.
#[test]
fn dedup_keys_come_from_the_marked_field() {
    #[derive(Serialize, Deserialize, DomainEvent)]
    enum UserEvent {
        Created {
            #[event(dedup_key)]
            request: String,
        },
        Renamed {
            #[event(dedup_key)]
            request: Option<uuid::Uuid>,
        },
        Deleted,
    }
    #[derive(Serialize, Deserialize, DomainEvent)]
    struct Imported {
        #[event(dedup_key)]
        source_row: String,
    }
    let id = uuid::Uuid::nil();
    let created = UserEvent::Created {
        request: "user-created:42".into(),
    };
    assert_eq!(created.dedup_key().as_deref(), Some("user-created:42"));
    let renamed = UserEvent::Renamed { request: Some(id) };
    assert_eq!(renamed.dedup_key(), Some(id.to_string()));
    assert_eq!(UserEvent::Renamed { request: None }.dedup_key(), None);
    assert_eq!(UserEvent::Deleted.dedup_key(), None);
    let imported = Imported {
        source_row: "r-7".into(),
    };
    assert_eq!(imported.dedup_key().as_deref(), Some("r-7"));
    assert_eq!(
        LimitRaised {
            region: 1,
            limit_cents: 2
        }
        .dedup_key(),
        None
    );
}
