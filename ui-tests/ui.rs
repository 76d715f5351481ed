//! Every compile-time error a user can meet, pinned with its message and span:
//! `ui-tests/{event,event_set,aggregate,unit_of_work}/*.rs`, each beside its `.stderr` (every
//! `*.rs` one directory down is a case). `TRYBUILD=overwrite cargo test -p outbox-ui-tests`
//! rewrites the expectations after a deliberate change; read the diff.

#[test]
fn compile_errors() {
    trybuild::TestCases::new().compile_fail("*/*.rs");
}
