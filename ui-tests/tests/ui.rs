//! Every compile-time error a user can meet, pinned with its message and span:
//! `ui-tests/{event,aggregate,unit_of_work}/*.rs`, each beside its `.stderr`.
//! `TRYBUILD=overwrite cargo test -p outbox-ui-tests` rewrites the expectations after a
//! deliberate change; read the diff.

#[test]
fn compile_errors() {
    let cases = trybuild::TestCases::new();
    for kind in ["event", "event_set", "aggregate", "unit_of_work"] {
        cases.compile_fail(format!("{kind}/*.rs"));
    }
}
